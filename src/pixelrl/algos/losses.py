"""Per-step policy-gradient losses for flow-matching policies (pure tensor functions).

A loss is called once per trained denoising step with a dict of [B] (or [B, *latent])
tensors and returns (scalar loss, metrics). It declares two key sets: `batch_keys`, what the
rollout batch must carry for it, and `step_keys`, what it reads from the step dict. Both are
checked and a missing key names the loss, the missing keys and the available ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from pixelrl.core.errors import ConfigError, MissingBatchKeysError
from pixelrl.core.registry import Registry
from pixelrl.sampling.sde import mean_over_dims

LOSSES: Registry = Registry("loss", "diffusion_loss.name")


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable
    batch_keys: tuple[str, ...]
    step_keys: tuple[str, ...]

    def __call__(self, step: dict, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        require_keys(f"loss `{self.name}`", self.step_keys, step.keys())
        return self.fn(step, cfg)


def require_keys(consumer: str, needed: Iterable[str], available: Iterable[str]) -> None:
    available = set(available)
    missing = [k for k in needed if k not in available]
    if missing:
        raise MissingBatchKeysError(consumer, missing, available)


def register_loss(name: str, *, batch_keys: Iterable[str], step_keys: Iterable[str], aliases: Iterable[str] = ()):
    def decorator(fn: Callable) -> LossSpec:
        spec = LossSpec(name, fn, tuple(batch_keys), tuple(step_keys))
        LOSSES.register(name, *aliases)(spec)
        return spec

    return decorator


def get_loss(name: str) -> LossSpec:
    return LOSSES.get(name)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0])


def clipped_policy_objective(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio: float,
                             adv_clip_max: float, weights: torch.Tensor | None = None):
    """PPO clip on per-sample ratios: mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))).

    Returns the loss and the ratio (for metrics). `weights` (e.g. truncated IS weights) are
    applied detached.
    """
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_sample = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_sample = per_sample * weights.detach()
    return per_sample.mean(), ratio


def ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, clip_ratio: float) -> dict[str, torch.Tensor]:
    r = ratio.detach()
    return {
        "clipfrac": ((r - 1.0).abs() > clip_ratio).float().mean(),
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(unbiased=False),
    }


@register_loss(
    "flow_grpo",
    batch_keys=("latents", "log_probs", "sigmas", "sigmas_next", "advantages"),
    step_keys=("log_prob", "old_log_prob", "advantages"),
    aliases=("dance_grpo",),
)
def flow_grpo_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """Flow-GRPO: clipped surrogate on per-step Gaussian log-prob ratios (eps = clip_ratio)."""
    log_ratio = step["log_prob"] - step["old_log_prob"]
    loss, ratio = clipped_policy_objective(
        log_ratio, step["advantages"], cfg.clip_ratio, cfg.adv_clip_max, step.get("is_weights")
    )
    return loss, {"pg_loss": loss.detach(), **ratio_metrics(log_ratio, ratio, cfg.clip_ratio)}


KL_TYPES = ("reference", "exact")


@register_loss("kl", batch_keys=("ref_means",), step_keys=("mean", "ref_mean", "std_dev_t", "noise_std"))
def kl_to_reference(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """KL between the Gaussian steps of the policy and the reference (same std).

    `reference` (Flow-GRPO code): mean_dims((mu - mu_ref)^2) / (2 std_dev_t^2), no dt.
    `exact`: divides by the variance actually sampled, (std_dev_t sqrt(-dt))^2 for sde.
    """
    sq = mean_over_dims((step["mean"] - step["ref_mean"].to(step["mean"].dtype)) ** 2)
    kl_type = getattr(cfg, "kl_type", "reference")
    if kl_type == "reference":
        var = _flat(step["std_dev_t"]) ** 2
    elif kl_type == "exact":
        var = _flat(step["noise_std"]) ** 2
    else:
        raise ConfigError("diffusion_loss.kl_type", kl_type, f"choose one of {list(KL_TYPES)}")
    kl = (sq / (2 * var)).mean()
    return kl, {"kl": kl.detach()}


@register_loss(
    "grpo_guard",
    batch_keys=("latents", "log_probs", "sigmas", "sigmas_next", "advantages", "old_means"),
    step_keys=("log_prob", "old_log_prob", "advantages", "mean", "old_mean", "std_dev_t", "sqrt_dt"),
)
def grpo_guard_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """GRPO-Guard: re-centre the log-ratio, whose mean drifts by -|mu - mu_old|^2 / (2 c^2)
    when the policy mean moves, and rescale it, so that clipping treats all steps alike.

    c = mean_B(std_dev_t) * mean_B(sqrt(-dt));  bias = mean_dims((mu - mu_old)^2) / (2 c^2)
    log_ratio = (logp - logp_old + bias) * c;  loss = clipped objective / mean_B(sqrt(-dt))^2
    """
    c = _flat(step["std_dev_t"]).mean() * _flat(step["sqrt_dt"]).mean()
    bias = mean_over_dims((step["mean"] - step["old_mean"].to(step["mean"].dtype)) ** 2) / (2 * c**2)
    raw_log_ratio = step["log_prob"] - step["old_log_prob"]
    log_ratio = (raw_log_ratio + bias) * c
    loss, ratio = clipped_policy_objective(
        log_ratio, step["advantages"], cfg.clip_ratio, cfg.adv_clip_max, step.get("is_weights")
    )
    loss = loss / _flat(step["sqrt_dt"]).mean() ** 2
    metrics = ratio_metrics(log_ratio, ratio, cfg.clip_ratio)
    # approx_kl measures how far the policy moved: on the raw log-ratio, as for flow_grpo.
    metrics["approx_kl"] = 0.5 * (raw_log_ratio.detach() ** 2).mean()
    return loss, {"pg_loss": loss.detach(), "guard_bias": bias.detach().mean(), **metrics}


@register_loss(
    "flow_dppo",
    batch_keys=("latents", "log_probs", "sigmas", "sigmas_next", "advantages", "old_means"),
    step_keys=("log_prob", "old_log_prob", "advantages", "mean", "old_mean", "noise_std"),
)
def flow_dppo_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """Flow-DPPO: no ratio clipping and no advantage clamp; instead drop a sample-step whose
    policy moved too far (per-step Gaussian divergence D >= tau) in the direction its advantage
    pushes.

    D = mean_dims((mu - mu_old)^2) / (2 (std_dev_t sqrt(-dt))^2)
    drop if D >= tau and (ratio > 1 and A > 0, or ratio < 1 and A < 0);  L = mean(keep * -A ratio)
    """
    adv = step["advantages"].detach()
    log_ratio = step["log_prob"] - step["old_log_prob"]
    ratio = torch.exp(log_ratio)
    divergence = mean_over_dims((step["mean"] - step["old_mean"].to(step["mean"].dtype)) ** 2) / (
        2 * _flat(step["noise_std"]) ** 2)
    too_far = divergence.detach() >= cfg.dppo_tau
    masked_pos = too_far & (ratio > 1) & (adv > 0)
    masked_neg = too_far & (ratio < 1) & (adv < 0)
    keep = (~(masked_pos | masked_neg)).float()
    per_sample = keep * (-adv * ratio)
    if step.get("is_weights") is not None:
        per_sample = per_sample * step["is_weights"].detach()
    loss = per_sample.mean()
    r = ratio.detach()
    return loss, {
        "pg_loss": loss.detach(), "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "ratio_mean": r.mean(), "ratio_std": r.std(unbiased=False),
        "dppo_masked_frac": 1 - keep.mean(), "dppo_masked_frac_pos": masked_pos.float().mean(),
        "dppo_masked_frac_neg": masked_neg.float().mean(), "dppo_divergence": divergence.detach().mean(),
    }
