"""On-policy distillation (`distill_kl`, a transition loss): the student samples; a frozen teacher
replays the student's stored window states with the student's grid, sampler, noise level and
guidance; each trained step pulls the student's Gaussian transition onto the teacher's.

Per trained sample-step: D = mean_dims((mu_student - mu_teacher)^2) / (2 var), the KL between two
Gaussian transitions of one variance. `variance` chooses var:
- `transition` (the default; Flow-Factory): the variance the step actually samples with,
  (std_dev_t sqrt(-dt))^2 for sde, std_dev_t^2 for cps: D is the true KL of the two steps.
- `scheduler` (verl-omni's DistillKLLoss): the scheduler's std_dev_t^2, which for sde leaves out
  the sqrt(-dt): each step's loss is 1 / (-dt) times its KL, about 10x on a 10-step grid and
  unequal along it, i.e. a larger learning rate that differs per step.
A step of zero variance (none is stored today: the rollout refuses ODE windows) would divide by 1,
as Flow-Factory does for ODE rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.algos.kl import gaussian_step_kl
from pixelrl.algos.losses import kept_mean, register_loss
from pixelrl.core.errors import ConfigError

DISTILL_VARIANCES = ("transition", "scheduler")
# the teacher that is the model itself with its adapters switched off (the reference)
BASE_TEACHER = "base"


@dataclass
class DistillKLParams:
    # `base`: the model with its adapters off; or a folder holding a LoRA of this family in the
    # diffusers layout (pytorch_lora_weights.safetensors with its LoraConfig): an RL run's
    # checkpoint (global_step_N: its actor's EMA when it kept one, else its actor), `pixelrl
    # export --adapter-only`, or any LoRA trained for this base
    teacher: str = BASE_TEACHER
    variance: str = "transition"  # transition (the step's sampled variance) | scheduler (verl-omni's std_dev_t)

    def __post_init__(self):
        if self.variance not in DISTILL_VARIANCES:
            raise ConfigError("diffusion_loss.params.variance", self.variance, f"choose one of {list(DISTILL_VARIANCES)}: "
                              "transition divides by the variance the step samples with (Flow-Factory), scheduler by "
                              "the scheduler's sigma_t^2 (verl-omni)")
        if not str(self.teacher).strip():
            raise ConfigError("diffusion_loss.params.teacher", self.teacher, f"`{BASE_TEACHER}` (the model with its "
                              "adapters off) or a folder holding the teacher's LoRA")


@register_loss(
    "distill_kl",
    batch_keys=("latents", "sigmas", "sigmas_next", "teacher_means"),
    step_keys=("mean", "teacher_mean", "std_dev_t", "noise_std"),
    params=DistillKLParams,
    steps_batchable=True,
)
def distill_kl_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """mean over trained sample-steps of mean_dims((mu - mu_teacher)^2) / (2 var): no reward, no
    advantage, no ratio (the student's own transition mean carries the gradient)."""
    std = step["noise_std"] if cfg.variance == "transition" else step["std_dev_t"]
    per_step = gaussian_step_kl(step["mean"], step["teacher_mean"], std)
    mask = step.get("step_mask")  # rollout correction's kept steps, scaled to the mini-batch's kept mean
    loss = per_step.mean() if mask is None else (per_step * mask).mean()
    return loss, {"distill_kl": kept_mean(per_step.detach(), mask)}
