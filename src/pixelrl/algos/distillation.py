"""On-policy distillation (`distill_kl`, a transition loss, or `diffusion_loss.distill_coef` x the
same term beside another one): the student samples; a frozen teacher replays the student's stored
window states with the student's grid, sampler, noise level and guidance; each trained step pulls
the student's Gaussian transition onto the teacher's.

Per trained sample-step: D = mean_dims((mu_student - mu_teacher)^2) / (2 var), the KL between two
Gaussian transitions of one variance. `diffusion_loss.distill_variance` chooses var:
- `transition` (the default; Flow-Factory): the variance the step actually samples with,
  (std_dev_t sqrt(-dt))^2 for sde, std_dev_t^2 for cps: D is the true KL of the two steps.
- `scheduler` (verl-omni's DistillKLLoss): the scheduler's std_dev_t^2, which for sde leaves out
  the sqrt(-dt): each step's loss is 1 / (-dt) times its KL, about 10x on a 10-step grid and
  unequal along it, i.e. a larger learning rate that differs per step.
A step of zero variance (`rollout.sde_type: ode`, DiffusionOPD's own point: the rollout stores
its deterministic Euler steps) divides by 1 under either choice: D = 0.5 mean((mu - mu_teacher)^2),
the surrogate DiffusionOPD and Flow-Factory use for ODE rollouts.
"""

from __future__ import annotations

import torch

from pixelrl.algos.kl import gaussian_step_kl
from pixelrl.algos.losses import kept_mean, register_loss
from pixelrl.core.errors import ConfigError

DISTILL_VARIANCES = ("transition", "scheduler")
# the teacher that is the model itself with its adapters switched off (the reference)
BASE_TEACHER = "base"


def teacher_routes(teacher) -> dict[str, str]:
    """`diffusion_loss.teacher` as {data_source or "*": `base` or a folder}, checked: a string is
    every sample's teacher; a mapping routes by the rows' data_source, "*" (else `base`) for the rest."""
    field = "diffusion_loss.teacher"
    routes = dict(teacher) if hasattr(teacher, "keys") else {"*": teacher}
    for source, spec in routes.items():
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{field}.{source}" if hasattr(teacher, "keys") else field, spec,
                              f"`{BASE_TEACHER}` (the model with its adapters off), a folder holding the teacher's "
                              "LoRA (pytorch_lora_weights.safetensors), a run's checkpoint or a pipeline folder")
    routes.setdefault("*", BASE_TEACHER)
    return routes


def distill_term(step: dict, variance: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over a call's sample-steps and its per-step values (detached): mean of
    mean_dims((mu - mu_teacher)^2) / (2 var), rejected steps out (step_mask)."""
    std = step["noise_std"] if variance == "transition" else step["std_dev_t"]
    per_step = gaussian_step_kl(step["mean"], step["teacher_mean"], std)
    mask = step.get("step_mask")  # rollout correction's kept steps, scaled to the mini-batch's kept mean
    loss = per_step.mean() if mask is None else (per_step * mask).mean()
    return loss, kept_mean(per_step.detach(), mask)


@register_loss(
    "distill_kl",
    batch_keys=("latents", "sigmas", "sigmas_next", "teacher_means"),
    step_keys=("mean", "teacher_mean", "std_dev_t", "noise_std"),
    steps_batchable=True,
)
def distill_kl_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """The whole loss: the student's transition onto the teacher's, no reward, advantage or ratio
    (the student's own transition mean carries the gradient)."""
    loss, value = distill_term(step, cfg.distill_variance)
    return loss, {"distill_kl": value}
