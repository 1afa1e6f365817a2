"""DMD2 (`algorithm.trainer_type: distribution_matching`, loss `dmd2`): distil a many-step model
into an S-step student with two trained roles on one base, the `student` (the run's policy
adapter) and a `fake_score` adapter that learns the student's own output distribution, against a
frozen teacher (the base with its adapters off, or a teacher LoRA).

Velocity convention v = noise - clean, x_s = (1 - s) x0 + s eps, x0_hat = x_s - s v.
- The student samples S Euler steps of a shifted grid, the rollout's (`rollout.sigma_schedule:
  linspace_shift`; S 4, `rollout.sigma_shift` 3: [1, .9, .75, .5, 0]), and
  stops at an exit index k drawn uniformly in [0, S), the same for every rank: the steps before
  k run without graph, and x_g is its x0 estimate at k (with graph).
- A score sigma per sample: j uniform in [0, T), s = shift(j / T) clamped to [low, high]
  (T = 0: s uniform in [low, high]); one eps; x_s = (1 - s) sg(x_g) + s eps for both scores.
- The teacher's velocity is guided, v_neg + w (v_pos - v_neg), optionally rescaled per channel
  vector to |v_pos| (`cfg_norm: layer_norm`); the fake score is conditional only.
- Student loss (float32): Z = max(mean_nonbatch |x_g - x_real|, 1e-6),
  g = nan_to_num((x_fake - x_real) / Z), L = 0.5 mean((x_g - sg(x_g - g))^2), whose gradient
  with respect to x_g is g / numel.
- Fake-score loss: flow matching on a detached student sample, mean((v_fake - (eps - x_g))^2).
- The update cycle: `cycle` names each role's attempts per training step, in order; each attempt
  samples fresh prompts and takes at most one optimizer step of that role.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pixelrl.algos.losses import LOSSES, register_loss
from pixelrl.algos.methods import MethodSpec, register_method
from pixelrl.core.errors import ConfigError
from pixelrl.sampling.schedule import time_shift

CFG_NORMS = ("none", "layer_norm")
TRAINED_ROLES = ("student", "fake_score")
# what a role section may change of the actor's optimizer settings
ROLE_OPTIMIZER_FIELDS = ("lr", "betas", "weight_decay", "adam_eps", "max_grad_norm", "warmup_steps", "lr_schedule",
                         "min_lr_ratio")


@dataclass
class DMD2Params:
    # the shift of the score-sigma draws (verl-omni: 3; the student's grid is the rollout's,
    # rollout.sigma_schedule=linspace_shift with rollout.sigma_shift)
    shift: float = 3.0
    # score sigmas: integer draws on a T-step grid (verl-omni, T 1000), or 0: uniform in the bounds
    # (Flow-Factory)
    score_timesteps: int = 1000
    score_sigma_range: list = field(default_factory=lambda: [0.02, 0.98])
    teacher_guidance: float = 4.0
    cfg_norm: str = "layer_norm"  # verl-omni rescales the guided velocity; Flow-Factory: none
    # the attempts of one training step, in order, each a role's (a list, so that an override
    # replaces it whole): verl-omni's student then fake twice; the paper's and Flow-Factory's five
    # fake updates then one of the student
    cycle: list = field(default_factory=lambda: ["student", "fake_score", "fake_score"])
    # the fake score's optimizer: these fields replace the actor's (actor.* is the student's)
    fake_score: dict = field(default_factory=lambda: {"lr": 2.0e-5})
    # true: one batch of prompts and initial noises per training step, replayed by every attempt
    # of the cycle, each with its own exit step, score sigma and score noise (Flow-Factory samples
    # one rollout per iteration for its fake and generator phases); false: fresh prompts and
    # noises for every attempt (verl-omni)
    reuse_rollout: bool = False

    def __post_init__(self) -> None:
        p = "diffusion_loss.params"
        if not self.shift > 0:
            raise ConfigError(f"{p}.shift", self.shift, "must be > 0 (verl-omni: 3)")
        if isinstance(self.score_timesteps, bool) or not isinstance(self.score_timesteps, int) or self.score_timesteps < 0:
            raise ConfigError(f"{p}.score_timesteps", self.score_timesteps, "a whole number >= 0 (1000: verl-omni's "
                              "grid; 0: uniform in score_sigma_range)")
        low_high = list(self.score_sigma_range)
        if len(low_high) != 2 or not 0 < low_high[0] < low_high[1] < 1:
            raise ConfigError(f"{p}.score_sigma_range", low_high, "[low, high] with 0 < low < high < 1 ([0.02, 0.98])")
        if not self.teacher_guidance >= 1:
            raise ConfigError(f"{p}.teacher_guidance", self.teacher_guidance, "must be >= 1 (1: no guidance)")
        if self.cfg_norm not in CFG_NORMS:
            raise ConfigError(f"{p}.cfg_norm", self.cfg_norm, f"choose one of {list(CFG_NORMS)}")
        cycle = list(self.cycle)
        if set(cycle) != set(TRAINED_ROLES):
            raise ConfigError(f"{p}.cycle", cycle, f"the attempts of a training step in order, each one of "
                              f"{list(TRAINED_ROLES)} and both present: [student, fake_score, fake_score] "
                              "(verl-omni) or [fake_score, fake_score, fake_score, fake_score, fake_score, student] "
                              "(the paper)")
        unknown = sorted(set(dict(self.fake_score)) - set(ROLE_OPTIMIZER_FIELDS))
        if unknown:
            raise ConfigError(f"{p}.fake_score", dict(self.fake_score), f"{unknown} are not optimizer settings; "
                              f"the fake score's section may set {list(ROLE_OPTIMIZER_FIELDS)} (the rest is actor.*)")


def update_cycle(params: DMD2Params) -> list[str]:
    """The roles' attempts of one training step, in order."""
    return [str(role) for role in params.cycle]


def cycle_of(loss_cfg) -> list[str]:
    """The update cycle the `diffusion_loss` section configures."""
    return update_cycle(LOSSES.get(loss_cfg.name).bind(loss_cfg))


def reuses_rollout(loss_cfg) -> bool:
    """Whether every attempt of a step replays the step's one rollout (`reuse_rollout`)."""
    return bool(LOSSES.get(loss_cfg.name).bind(loss_cfg).reuse_rollout)


def check_distribution_matching(cfg) -> None:
    """DMD2's student samples the shifted linspace grid deterministically, as two LoRA adapters
    (student, fake score) on one base beside its teacher (reads rollout, val_kwargs, model and
    diffusion_loss)."""
    r = cfg.rollout
    if r.output_aspect != "square":
        raise ConfigError("rollout.output_aspect", r.output_aspect, "the DMD2 student samples rollout.resolution "
                          "squares (its fake score and teacher replay them at that size): leave it at square")
    if r.sigma_schedule != "linspace_shift":
        raise ConfigError("rollout.sigma_schedule", r.sigma_schedule, "the DMD2 student samples a shifted linspace "
                          "grid (verl-omni: rollout.sigma_schedule=linspace_shift, rollout.sigma_shift=3; 4 steps: "
                          "[1, .9, .75, .5, 0]), and validation and `pixelrl generate` must sample the same one")
    if r.noise_level != 0:
        raise ConfigError("rollout.noise_level", r.noise_level, "the DMD2 student takes deterministic Euler steps: "
                          "set rollout.noise_level=0")
    if cfg.val_kwargs.num_steps != r.num_steps:
        raise ConfigError("val_kwargs.num_steps", cfg.val_kwargs.num_steps, f"the DMD2 student is distilled for "
                          f"rollout.num_steps={r.num_steps} steps of its grid: validate it at those "
                          f"(val_kwargs.num_steps={r.num_steps})")
    if cfg.model.lora_rank == 0:
        raise ConfigError("model.lora_rank", 0, "DMD2 trains the student and the fake score as two LoRA adapters on "
                          "one base (the teacher is that base): set model.lora_rank > 0")
    if cfg.diffusion_loss.kl_coef > 0:
        raise ConfigError("diffusion_loss.kl_coef", cfg.diffusion_loss.kl_coef, "DMD2 has no reference KL term: set 0")


register_method(MethodSpec("distribution_matching", trained_roles=TRAINED_ROLES, samples_through_producer=False,
                           reads_rewards=False, reads_teacher=True, attempt_cycle=cycle_of,
                           training_metrics=("student/loss", "fake_score/loss"),
                           check=check_distribution_matching))


def draw_score_sigmas(n: int, generator: torch.Generator, *, timesteps: int, shift: float,
                      low: float, high: float) -> torch.Tensor:
    """[n] sigmas at which the teacher and the fake score judge the student's samples."""
    if timesteps:
        j = torch.randint(0, timesteps, (n,), generator=generator, dtype=torch.long)
        return time_shift(j.double() / timesteps, shift).clamp(low, high).float()
    return (low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)).float()


def channel_dim(latents: torch.Tensor) -> int:
    """The channel axis of a latent batch: the last of packed tokens [B, L, C], else axis 1
    ([B, C, H, W] images, [B, C, T, H, W] videos)."""
    return -1 if latents.ndim == 3 else 1


def guided_velocity(v_pos: torch.Tensor, v_neg: torch.Tensor | None, scale: float, cfg_norm: str,
                    token_patch: int = 1) -> torch.Tensor:
    """The teacher's guided velocity; `layer_norm` rescales each token's vector to the conditional
    velocity's length, |v_pos| / max(|v_guided|, 1e-12) (verl-omni's `standard_cfg`, on the last
    axis of the denoiser's packed tokens). `token_patch` is the side of the latent patch one
    denoiser token packs (the family's `guidance_token_patch`: 2 for Qwen-Image, whose tokens are
    2 x 2 latent cells x 16 channels): on unpacked `[B, C, H, W]` latents a token's vector is then
    the channels of a token_patch x token_patch block, not of one latent cell."""
    if v_neg is None or scale == 1.0:
        return v_pos
    guided = v_neg + scale * (v_pos - v_neg)
    if cfg_norm == "layer_norm":
        guided = guided * (_token_norms(v_pos, token_patch) / _token_norms(guided, token_patch).clamp_min(1e-12))
    return guided


def _token_norms(v: torch.Tensor, token_patch: int) -> torch.Tensor:
    """Each denoiser token's vector length, broadcast back over the token's latent values."""
    dim = channel_dim(v)
    if token_patch == 1 or dim == -1:
        return v.norm(dim=dim, keepdim=True)
    if v.ndim != 4 or v.shape[2] % token_patch or v.shape[3] % token_patch:
        raise ValueError(f"a {token_patch} x {token_patch} token rescale needs [B, C, H, W] latents with H and W "
                         f"divisible by {token_patch}, got {tuple(v.shape)}")
    b, c, h, w = v.shape
    p = token_patch
    blocks = v.reshape(b, c, h // p, p, w // p, p)
    norms = blocks.square().sum(dim=(1, 3, 5), keepdim=True).sqrt()  # [B, 1, H/p, 1, W/p, 1]
    return norms.expand(b, 1, h // p, p, w // p, p).reshape(b, 1, h, w)


def x0_from_velocity(x_s: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x_s - _per_sample(sigma, x_s) * v


def noised(x0: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * eps


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma.to(like).reshape(-1, *([1] * (like.ndim - 1)))


def student_loss(x_g: torch.Tensor, x_real: torch.Tensor, x_fake: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """DMD2's generator loss and its metrics; gradient g / numel with respect to x_g."""
    x_g = x_g.float()
    detached = x_g.detach()
    dims = tuple(range(1, x_g.ndim))
    scale = (detached - x_real.float()).abs().mean(dims, keepdim=True).clamp_min(1e-6)
    grad = torch.nan_to_num((x_fake.float() - x_real.float()) / scale)
    loss = 0.5 * ((x_g - (detached - grad)) ** 2).mean()
    return loss, {"dmd_grad_norm": grad.detach().flatten(1).norm(dim=1).mean(), "dmd_scale": scale.mean()}


def fake_score_loss(v_fake: torch.Tensor, eps: torch.Tensor, x_g: torch.Tensor) -> torch.Tensor:
    """Flow matching of the fake score on the (detached) student sample."""
    return ((v_fake.float() - (eps.float() - x_g.detach().float())) ** 2).mean()


@register_loss("dmd2", objective="distribution_matching", params=DMD2Params,
               batch_keys=("prompts", "seeds"), step_keys=("x_g", "x_real", "x_fake"))
def dmd2_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """The student's attempt (the fake score's is `fake_score_loss`)."""
    return student_loss(step["x_g"], step["x_real"], step["x_fake"])
