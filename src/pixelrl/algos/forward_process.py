"""Forward-process losses: trained on clean samples noised at sampled timesteps, not on stored
SDE trajectories (objective `forward_process`). Pure tensor functions; equations and the
reference-code conventions are in docs/algorithms/ (diffusion_dpo.md, diffusion_nft.md, awm.md).

Notation: x_t = (1 - t) x0 + t eps, the velocity target is eps - x0, "mean over dims" is the
mean over every non-batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pixelrl.algos.losses import positive, register_loss
from pixelrl.algos.methods import MethodSpec, register_method
from pixelrl.core.errors import ConfigError, require_integer
from pixelrl.sampling.schedule import time_shift as shifted
from pixelrl.sampling.sde import mean_over_dims


def check_forward_process(cfg) -> None:
    """A forward-process loss sets its own reference term in its params (reads diffusion_loss)."""
    if cfg.diffusion_loss.kl_coef > 0:
        raise ConfigError("diffusion_loss.kl_coef", cfg.diffusion_loss.kl_coef, "the KL coefficient belongs to "
                          "transition losses; forward-process losses set their reference term in diffusion_loss.params")


# Diffusion-DPO, DiffusionNFT, AWM, DGPO: the producer's clean samples re-noised at drawn timesteps
# offline Diffusion-DPO samples nothing in training: its implicit accuracy says how it goes
register_method(MethodSpec("forward_process", training_metrics=("critic/rewards/mean", "actor/implicit_acc"),
                           check=check_forward_process))


# AWM's grid strata (the reference's `time_type`s): K strata of the sampler's grid indices up to
# int(N * fraction), one index drawn uniformly from each. `discrete_wo_init` (the released default)
# starts at index 1 (t = 1, pure noise, is never trained), `discrete` at 0, `discrete_with_init`
# always trains index 0 and splits 1.. into K - 1 strata.
GRID_STRATA = ("discrete_wo_init", "discrete", "discrete_with_init")
# AWM's continuous samplers (the reference's `logit_normal` and `uniform` time_types): K stratified
# draws per sample, then shifted by `time_shift`
CONTINUOUS_STRATA = ("stratified_logit_normal", "stratified_uniform")
TIMESTEP_SAMPLERS = ("logit_normal", "grid_permutation", *GRID_STRATA, *CONTINUOUS_STRATA, "grid_subset")
# drawn once per update and shared by every row of every worker (DGPO's, by design)
SHARED_TIMESTEP_SAMPLERS = ("grid_subset",)


def check_timesteps(params) -> None:
    if params.timesteps not in TIMESTEP_SAMPLERS:
        hint = " (grid_stratified, pixelrl's earlier AWM rule, became discrete_wo_init: the reference's)" \
            if params.timesteps == "grid_stratified" else ""
        raise ConfigError("diffusion_loss.params.timesteps", params.timesteps,
                          f"choose one of {list(TIMESTEP_SAMPLERS)}{hint}")
    if hasattr(params, "num_timesteps"):
        positive("num_timesteps", params.num_timesteps)
    if hasattr(params, "timestep_fraction") and not 0 < params.timestep_fraction <= 1:
        raise ConfigError("diffusion_loss.params.timestep_fraction", params.timestep_fraction, "must be in (0, 1]")


def grid_strata(kind: str, num_steps: int, num_timesteps: int, fraction: float,
                top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[K] lower and upper (exclusive) grid indices of each stratum, as the AWM reference computes
    them: boundaries = linspace(start, top, strata + 1), floored; top = int(N * fraction) unless
    given (`strata_top`)."""
    top = int(num_steps * fraction) if top is None else top
    start, strata = (0, num_timesteps) if kind == "discrete" else (1, num_timesteps - (kind == "discrete_with_init"))
    boundaries = torch.linspace(start, top, strata + 1).long()
    lower, upper = boundaries[:-1], boundaries[1:]
    if kind == "discrete_with_init":
        lower, upper = torch.cat([torch.tensor([0]), lower]), torch.cat([torch.tensor([1]), upper])
    return lower, upper


def strata_top(grid: torch.Tensor, min_sigma: float) -> int | None:
    """With min_sigma > 0, the last grid index whose sigma is at least min_sigma: where
    Flow-Factory's `discrete` time sampling ends its strata (its `timestep_range` r keeps the grid
    timesteps in [1000 (1 - r), 1000], here min_sigma = 1 - r, so the grid's shift decides how many
    indices that is); None (int(N x fraction)) without one."""
    if min_sigma <= 0:
        return None
    kept = torch.nonzero(grid >= min_sigma - 1e-6).flatten()
    return int(kept.max()) if kept.numel() else 0


def grid_subset_top(num_steps: int, max_index: int | None) -> int:
    """The highest grid index `grid_subset` draws from: max_index, within the N-step grid."""
    return num_steps - 1 if max_index is None else min(num_steps - 1, max_index)


def check_strata(kind: str, num_timesteps: int, num_steps: int, fraction: float, max_index: int | None = None,
                 top: int | None = None) -> None:
    """Every stratum must hold at least one grid index (the reference then draws its lower bound
    for every empty one, training one timestep several times); `grid_subset` draws distinct
    indices, so the grid must hold that many up to max_index."""
    if kind == "grid_subset":
        top = grid_subset_top(num_steps, max_index)
        if num_timesteps > top + 1:
            raise ConfigError("diffusion_loss.params.num_timesteps", num_timesteps,
                              f"draws distinct grid indices out of 0..{top} (rollout.num_steps={num_steps}): "
                              f"use at most {top + 1}")
        return
    if kind not in GRID_STRATA:
        return
    lower, upper = grid_strata(kind, num_steps, num_timesteps, fraction, top)
    if bool((upper <= lower).any()):
        bound = f"int(rollout.num_steps x timestep_fraction) = {int(num_steps * fraction)}" if top is None else \
            f"the last grid index with sigma >= min_sigma, {top}"
        raise ConfigError("diffusion_loss.params.num_timesteps", num_timesteps,
                          f"{num_timesteps} `{kind}` strata of grid indices up to {bound} leave some stratum empty: "
                          f"use fewer timesteps, or raise rollout.num_steps (it is {num_steps}) or "
                          + ("timestep_fraction" if top is None else "lower min_sigma"))


def draw_timesteps(kind: str, batch_size: int, *, grid: torch.Tensor, train_sigmas: torch.Tensor,
                   generator: torch.Generator, num_timesteps: int = 1, fraction: float = 1.0,
                   time_shift: float = 3.0, max_index: int | None = None, min_sigma: float = 0.0) -> torch.Tensor:
    """[B, K] noise levels t in (0, 1] at which each sample is trained.

    - logit_normal (Diffusion-DPO on flow models): u ~ sigmoid(N(0, 1)), t = train_sigmas[floor(1000 u)]
      of the 1000-step training schedule; K = num_timesteps.
    - grid_permutation (DiffusionNFT): the N sampler grid values (sigmas[:-1], t = 1 included), a
      random permutation per sample, the first K = max(1, int(N * fraction)).
    - discrete_wo_init / discrete / discrete_with_init (AWM): one uniform grid index from each of
      the K strata of `grid_strata`, per sample (the reference shares one draw per micro-batch);
      with min_sigma the strata end at `strata_top` (Flow-Factory's discrete time sampling).
    - stratified_logit_normal (AWM): u_k = (k + U) / K, t = shift(sigmoid(Phi^-1(u_k))) clamped
      to >= 0.01; stratified_uniform: t = shift(0.2 + 0.8 (k + U) / K). Per sample.
    - grid_subset (DGPO): K distinct grid indices out of 0..max_index, drawn once and shared by
      every sample (the reference's random.sample(range(trunc_steps + 1), K)).
    """
    n = grid.numel()
    if kind == "logit_normal":
        u = torch.sigmoid(torch.randn(batch_size, num_timesteps, generator=generator))
        idx = (u * train_sigmas.numel()).long().clamp(max=train_sigmas.numel() - 1)
        return train_sigmas[idx]
    if kind == "grid_permutation":
        k = max(1, int(n * fraction))
        return torch.stack([grid[torch.randperm(n, generator=generator)[:k]] for _ in range(batch_size)])
    if kind in GRID_STRATA:
        top = strata_top(grid, min_sigma)
        check_strata(kind, num_timesteps, n, fraction, top=top)
        lower, upper = grid_strata(kind, n, num_timesteps, fraction, top)
        u = torch.rand(batch_size, num_timesteps, generator=generator)
        return grid[lower + (u * (upper - lower)).long()]
    if kind == "grid_subset":
        check_strata(kind, num_timesteps, n, fraction, max_index)
        picked = torch.randperm(grid_subset_top(n, max_index) + 1, generator=generator)[:num_timesteps]
        return grid[picked].unsqueeze(0).expand(batch_size, -1).clone()
    if kind in CONTINUOUS_STRATA:
        u = (torch.arange(num_timesteps) + torch.rand(batch_size, num_timesteps, generator=generator)) / num_timesteps
        if kind == "stratified_uniform":
            return shifted(0.2 + 0.8 * u, time_shift)
        normal = torch.distributions.Normal(0.0, 1.0)
        return shifted(torch.sigmoid(normal.icdf(u.clamp(1e-7, 1 - 1e-7))), time_shift).clamp(min=0.01)
    raise ConfigError("diffusion_loss.params.timesteps", kind, f"choose one of {list(TIMESTEP_SAMPLERS)}")


# ----------------------------------------------------------------------------- Diffusion-DPO
@dataclass
class DiffusionDPOParams:
    beta: float = 100.0  # every flow-model recipe uses 100 (the mean over dims sets its scale)
    # (noise, timestep) draws per pair and epoch; t from the 1000-step training schedule at
    # idx = floor(1000 u), u ~ LogitNormal(0, 1)
    timesteps: str = "logit_normal"
    num_timesteps: int = 1

    def __post_init__(self):
        positive("beta", self.beta)
        check_timesteps(self)


@register_loss("diffusion_dpo", objective="forward_process", params=DiffusionDPOParams,
               batch_keys=("x0", "x0_rejected"),
               step_keys=("err_chosen", "err_rejected", "ref_err_chosen", "ref_err_rejected"))
def diffusion_dpo_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """Diffusion-DPO on pairs that share noise and timestep; err = mean_dims((v - (eps - x0))^2).

    inside = -0.5 beta ((err_w - err_ref_w) - (err_l - err_ref_l));  L = -log sigmoid(inside)
    Implicit rewards: chosen -0.5 beta (err_w - err_ref_w), rejected likewise; accuracy = inside > 0.
    """
    chosen = -0.5 * cfg.beta * (step["err_chosen"] - step["ref_err_chosen"].detach())
    rejected = -0.5 * cfg.beta * (step["err_rejected"] - step["ref_err_rejected"].detach())
    inside = chosen - rejected
    loss = -F.logsigmoid(inside).mean()
    return loss, {
        "dpo_loss": loss.detach(), "implicit_acc": (inside.detach() > 0).float().mean(),
        "rewards_chosen": chosen.detach().mean(), "rewards_rejected": rejected.detach().mean(),
        "reward_margin": inside.detach().mean(),
        "err_chosen": step["err_chosen"].detach().mean(), "err_rejected": step["err_rejected"].detach().mean(),
        "ref_err_chosen": step["ref_err_chosen"].mean(), "ref_err_rejected": step["ref_err_rejected"].mean(),
    }


# ----------------------------------------------------------------------------- DiffusionNFT
NFT_ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float = 5.0, mode: str = "all") -> torch.Tensor:
    """Optimality probability r in [0, 1] from advantages: clamp to [-c, c], apply `mode`, then
    r = clamp(A / c / 2 + 0.5, 0, 1). `binary` gives r in {0.4, 0.5, 0.6} and `one_only`
    r in {0.5, 0.6} for c = 5 (the mode acts before the division by c, as in the reference)."""
    c = adv_clip_max
    a = advantages.clamp(-c, c)
    if mode == "positive_only":
        a = a.clamp(0, c)
    elif mode == "negative_only":
        a = a.clamp(-c, 0)
    elif mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "all":
        raise ConfigError("diffusion_loss.params.adv_mode", mode, f"choose one of {list(NFT_ADV_MODES)}")
    return (a / c / 2 + 0.5).clamp(0, 1)


# ----------------------------------------------------------------------------- old-policy EMA
OLD_POLICY_SCHEDULES = ("copy", "linear_to_0_5", "delayed", "awm", "constant")
OLD_POLICY_REFRESHES = ("update", "optimizer_step")  # what old_policy_update_interval counts
# what the schedule's step counts: the optimizer steps taken, or the updates before this one
# (Flow-Factory's epoch counter, whatever its optimizer steps per epoch)
OLD_POLICY_CLOCKS = ("optimizer_steps", "updates")


def old_policy_decay(schedule: str, step: int, constant: float = 0.0) -> float:
    """Decay d of the old-policy update old = d old + (1 - d) current, from the optimizer-step
    count `step`: copy 0; linear_to_0_5 min(0.001 step, 0.5) (DiffusionNFT default); delayed
    0 before step 75, then min(0.0075 (step - 75), 0.999) (DiffusionNFT OCR); awm
    min(0.3, 0.001 step) (AWM's EMA adapter); constant `constant`."""
    if schedule == "copy":
        return 0.0
    if schedule == "linear_to_0_5":
        return min(0.001 * step, 0.5)
    if schedule == "delayed":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    if schedule == "awm":
        return min(0.3, 0.001 * step)
    if schedule == "constant":
        return float(constant)
    raise ConfigError("diffusion_loss.params.old_policy_schedule", schedule,
                      f"choose one of {list(OLD_POLICY_SCHEDULES)}")


@dataclass
class OldPolicyParams:
    """The `old` adapter of DiffusionNFT, AWM and DGPO: old = d old + (1 - d) current every
    `old_policy_update_interval` updates (`old_policy_refresh: update`, after the update's last
    optimizer step, d from the optimizer steps taken) or optimizer steps (`optimizer_step`, after
    each, d from the steps before it, as DGPO's reference steps its EMA reference), d from
    `old_policy_schedule` (`old_policy_decay` for `constant`) at the step `old_policy_clock` counts;
    `rollout_policy: old` samples the rollouts with it (DiffusionNFT's reference)."""
    old_policy_schedule: str = "linear_to_0_5"
    old_policy_decay: float = 0.0
    old_policy_update_interval: int = 1
    old_policy_refresh: str = "update"
    old_policy_clock: str = "optimizer_steps"
    rollout_policy: str = "current"

    def __post_init__(self):
        if self.old_policy_schedule not in OLD_POLICY_SCHEDULES:
            raise ConfigError("diffusion_loss.params.old_policy_schedule", self.old_policy_schedule,
                              f"choose one of {list(OLD_POLICY_SCHEDULES)}")
        if not 0 <= self.old_policy_decay < 1:
            raise ConfigError("diffusion_loss.params.old_policy_decay", self.old_policy_decay, "must be in [0, 1)")
        require_integer("diffusion_loss.params.old_policy_update_interval", self.old_policy_update_interval, 1)
        if self.old_policy_refresh not in OLD_POLICY_REFRESHES:
            raise ConfigError("diffusion_loss.params.old_policy_refresh", self.old_policy_refresh,
                              f"choose one of {list(OLD_POLICY_REFRESHES)}")
        if self.old_policy_clock not in OLD_POLICY_CLOCKS:
            raise ConfigError("diffusion_loss.params.old_policy_clock", self.old_policy_clock,
                              f"choose one of {list(OLD_POLICY_CLOCKS)}")
        if self.old_policy_clock == "updates" and self.old_policy_refresh != "update":
            raise ConfigError("diffusion_loss.params.old_policy_clock", self.old_policy_clock,
                              "counts updates, and old_policy_refresh=optimizer_step refreshes between them: use "
                              "old_policy_refresh=update, or old_policy_clock=optimizer_steps")
        if self.rollout_policy not in ("current", "old"):
            raise ConfigError("diffusion_loss.params.rollout_policy", self.rollout_policy, "choose one of "
                              "['current', 'old']")


def rollout_policy(options) -> str:
    """Which adapter samples the rollouts under a loss's bound options (`LossSpec.bind`)."""
    return getattr(options, "rollout_policy", "current")


@dataclass
class DiffusionNFTParams(OldPolicyParams):
    beta: float = 1.0  # mix of current and old velocity in the implicit policies (0.1 for OCR)
    ref_kl_coef: float = 1e-4  # weight of mean((v - v_ref)^2); the reference code calls it train.beta
    adv_mode: str = "all"
    # per sample, a random permutation of the sampler's grid timesteps, of which the first
    # int(N * fraction) are trained (9 of 10); or AWM's grid strata (Flow-Factory's NFT: `discrete`)
    timesteps: str = "grid_permutation"
    timestep_fraction: float = 0.99
    num_timesteps: int = 1  # the strata samplers' K (grid_permutation trains int(N x fraction))
    # > 0: the strata end at the last grid index with sigma >= min_sigma, not at int(N x fraction)
    # (Flow-Factory's timestep_range r is min_sigma = 1 - r)
    min_sigma: float = 0.0
    group_noise: bool = False  # see AWMParams.group_noise

    def __post_init__(self):
        super().__post_init__()
        positive("beta", self.beta)
        check_timesteps(self)
        if not 0 <= self.min_sigma < 1:
            raise ConfigError("diffusion_loss.params.min_sigma", self.min_sigma, "must be in [0, 1) (0: the strata end "
                              "at int(rollout.num_steps x timestep_fraction))")
        if self.min_sigma and self.timesteps not in GRID_STRATA:
            raise ConfigError("diffusion_loss.params.min_sigma", self.min_sigma, f"ends the strata of {list(GRID_STRATA)}"
                              f"; timesteps={self.timesteps} has none: leave it at 0")
        if self.ref_kl_coef < 0:
            raise ConfigError("diffusion_loss.params.ref_kl_coef", self.ref_kl_coef, "must be >= 0")
        if self.adv_mode not in NFT_ADV_MODES:
            raise ConfigError("diffusion_loss.params.adv_mode", self.adv_mode, f"choose one of {list(NFT_ADV_MODES)}")


def _adaptive_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """mean_dims((x0_pred - x0)^2) / w with w = detach(max(mean_dims(|x0_pred - x0|), 1e-5)) in float64."""
    with torch.no_grad():
        w = mean_over_dims((x0_pred.double() - x0.double()).abs()).clamp(min=1e-5)
    return mean_over_dims((x0_pred - x0) ** 2) / w.to(x0_pred.dtype)


@register_loss("diffusion_nft", objective="forward_process", params=DiffusionNFTParams,
               batch_keys=("x0", "advantages"),
               step_keys=("x0", "x_t", "t", "v", "v_old", "v_ref", "advantages"))
def diffusion_nft_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT (code form): implicit positive and negative policies around the old one.

    v+ = beta v + (1 - beta) v_old;  v- = (1 + beta) v_old - beta v;  x0+- = x_t - t v+-
    L = c mean((r err(x0+) + (1 - r) err(x0-)) / beta) + ref_kl_coef mean_B(mean_dims((v - v_ref)^2))
    with err the adaptively weighted x0 error and c = adv_clip_max.
    """
    v, v_old, x0, x_t = step["v"], step["v_old"].detach(), step["x0"], step["x_t"]
    t = step["t"].reshape(-1, *([1] * (x0.ndim - 1)))
    r = nft_optimality(step["advantages"], cfg.adv_clip_max, cfg.adv_mode)
    v_pos = cfg.beta * v + (1 - cfg.beta) * v_old
    v_neg = (1 + cfg.beta) * v_old - cfg.beta * v
    pos = _adaptive_x0_error(x_t - t * v_pos, x0)
    neg = _adaptive_x0_error(x_t - t * v_neg, x0)
    policy = cfg.adv_clip_max * ((r * pos + (1 - r) * neg) / cfg.beta).mean()
    kl = mean_over_dims((v - step["v_ref"].detach()) ** 2).mean()
    loss = policy + cfg.ref_kl_coef * kl
    return loss, {"policy_loss": policy.detach(), "ref_kl": kl.detach(), "optimality_mean": r.mean(),
                  "old_deviation": mean_over_dims((v.detach() - v_old) ** 2).mean()}


# ----------------------------------------------------------------------------- AWM
AWM_WEIGHTINGS = ("ghuber", "uniform", "t", "t**2", "huber")



@dataclass
class AWMParams(OldPolicyParams):
    weighting: str = "ghuber"  # the released default
    p: float = 0.25  # ghuber exponent
    beta_ref: float = 1e-3  # weight of mean((v - v_ref)^2); the reference's GenEval preset (3e-3 before be51372)
    ema_beta: float = 1.0  # weight of mean((v - v_ema)^2) against the `old` adapter kept as an EMA
    # the reference's `discrete_wo_init`: one grid index from each of 6 strata of the indices
    # 1 .. int(N x 0.9) per sample ({1}, {2, 3}, ..., {10, 11} at N = 14)
    timesteps: str = "discrete_wo_init"
    num_timesteps: int = 6
    timestep_fraction: float = 0.9
    time_shift: float = 3.0  # the continuous samplers' shift (the reference's config.time_shift)
    # PPO clip of the ratio exp(logp - logp_old) on every optimizer step that is not on-policy
    # (the reference's train.clip_range: 1, so the ratio is kept in [0, 2])
    clip_range: float = 1.0
    # pixelrl's option, off in the references: every image of a prompt's group is noised with the
    # same timesteps and noise, as Diffusion-DPO noises a pair. The advantages of a group sum to 0,
    # so the part of the gradient the images share through (t, eps) cancels, not only in expectation
    group_noise: bool = False
    # how many samples share one draw of the K timesteps (each keeps its own noise): 1 draws per
    # sample; the reference repeats one draw over its config.train.batch_size samples (3 in its
    # SD3.5 presets), trained together. pixelrl shares it over that many samples of the step, picked
    # at random, whatever micro-batch memory allows. The same distribution per sample either way
    samples_per_timestep_draw: int = 1
    old_policy_schedule: str = "awm"  # the EMA adapter's decay min(0.3, 0.001 step), the reference's

    def __post_init__(self):
        super().__post_init__()
        check_timesteps(self)
        positive("time_shift", self.time_shift)
        positive("clip_range", self.clip_range)
        if self.samples_per_timestep_draw < 1:
            raise ConfigError("diffusion_loss.params.samples_per_timestep_draw", self.samples_per_timestep_draw,
                              "must be >= 1 (1 draws the timesteps per sample)")
        if self.samples_per_timestep_draw > 1 and self.group_noise:
            raise ConfigError("diffusion_loss.params.samples_per_timestep_draw", self.samples_per_timestep_draw,
                              "group_noise already shares each prompt group's timesteps and noise: use one of the two")
        if self.weighting not in AWM_WEIGHTINGS:
            raise ConfigError("diffusion_loss.params.weighting", self.weighting, f"choose one of {list(AWM_WEIGHTINGS)}")
        positive("p", self.p)
        for name in ("beta_ref", "ema_beta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"diffusion_loss.params.{name}", getattr(self, name), "must be >= 0")


def flow_matching_error(v: torch.Tensor, eps: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """[B] mean_dims((v - (eps - x0))^2) in float64: AWM's per-sample error, of the current policy
    in the loss and of the old one in the objective's pass before an off-policy update."""
    return mean_over_dims((v.double() - (eps - x0).double()) ** 2)


def awm_log_prob(err: torch.Tensor, t: torch.Tensor, weighting: str = "ghuber", p: float = 0.25) -> torch.Tensor:
    """The surrogate log-likelihood of a per-sample flow-matching error `err` (float64) at noise level t.

    ghuber (the released default): -t ((err + 1e-10)^p - 1e-10^p) / p, gradient -t (err + 1e-10)^(p-1) d err;
    uniform: -err (the plain advantage-weighted flow-matching loss); t: -t err; t**2: -t^2 err;
    huber: -t (sqrt(err + 1e-10) - 1e-5)."""
    t = t.to(err.dtype)
    if weighting == "ghuber":
        return -t * ((err + 1e-10) ** p - 1e-10 ** p) / p
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -t * err
    if weighting == "t**2":
        return -t ** 2 * err
    if weighting == "huber":
        return -t * (torch.sqrt(err + 1e-10) - 1e-5)
    raise ConfigError("diffusion_loss.params.weighting", weighting, f"choose one of {list(AWM_WEIGHTINGS)}")


@register_loss("awm", objective="forward_process", params=AWMParams,
               batch_keys=("x0", "advantages"),
               step_keys=("x0", "eps", "t", "v", "v_ref", "v_old", "advantages"),
               weighted_step_keys={"v_ref": "beta_ref", "v_old": "ema_beta"})
def awm_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """Advantage-weighted matching: err = mean_dims((v - (eps - x0))^2) in float64,
    logp = awm_log_prob(err, t), ratio = exp(logp - logp_old) with logp_old from `err_old` (the old
    policy's error at the same t and eps, on an optimizer step that is not on-policy) or detach(logp)
    (on-policy: 1 in value), A' = clamp(A, -c, c) / c,
    L = mean(max(-A' ratio, -A' clamp(ratio, 1 - clip_range, 1 + clip_range)))
        + beta_ref mean((v - v_ref)^2) + ema_beta mean((v - v_ema)^2).
    On-policy the gradient is -A' d logp: a per-sample weighted flow-matching loss.
    A term whose weight is 0 is left out (its velocity is None: the engine skips that forward)."""
    v = step["v"]
    err = flow_matching_error(v, step["eps"], step["x0"])
    logp = awm_log_prob(err, step["t"], cfg.weighting, cfg.p)
    err_old = step.get("err_old")
    logp_old = logp.detach() if err_old is None else awm_log_prob(err_old.double(), step["t"], cfg.weighting, cfg.p)
    ratio = torch.exp(logp - logp_old)
    adv = step["advantages"].double().clamp(-cfg.adv_clip_max, cfg.adv_clip_max) / cfg.adv_clip_max
    clipped = ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)
    policy = torch.maximum(-adv * ratio, -adv * clipped).mean()
    loss = policy.to(v.dtype)
    metrics = {"policy_loss": policy.detach().float(), "fm_error": err.detach().mean().float(),
               "clipfrac": ((ratio.detach() - 1).abs() > cfg.clip_range).float().mean(),
               "ratio_mean": ratio.detach().mean().float()}
    for weight, key, name in ((cfg.beta_ref, "v_ref", "ref_deviation"), (cfg.ema_beta, "v_old", "ema_deviation")):
        if weight:
            deviation = mean_over_dims((v - step[key].detach()) ** 2).mean()
            loss = loss + weight * deviation
            metrics[name] = deviation.detach()
    return loss, metrics


def best_worst_pairs(rewards: torch.Tensor, group_ids) -> tuple[list[int], list[int]]:
    """One (chosen, rejected) pair per group: the highest and the lowest reward, as the last and
    first entries of a stable ascending sort (ties are still paired; groups of one are skipped).
    Returns the chosen and the rejected indices, in order of the groups' first appearance."""
    groups: dict = {}
    for i, g in enumerate(group_ids.tolist() if isinstance(group_ids, torch.Tensor) else group_ids):
        groups.setdefault(g, []).append(i)
    chosen, rejected = [], []
    values = rewards.tolist()
    for members in groups.values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda i: values[i])  # Python's sort is stable
        chosen.append(ordered[-1])
        rejected.append(ordered[0])
    return chosen, rejected
