"""Rollout correction: when the policy that sampled a batch differs from the one being trained
(asynchronous rollout, a different inference engine, numerical drift), re-weight each step and
reject outliers, with verl's aggregation levels (a "token" here is one sample-step of the SDE)."""

from __future__ import annotations

import torch

# exp(+-20): the log-ratio is clamped before exponentiating, as verl does, so one far-off step
# cannot overflow a weight or a sequence product
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
# token, sequence and geometric as verl's rollout_rs; any_step rejects a whole sample when any of
# its steps leaves the bounds (pixelrl's earlier rule, kept under its own name)
RS_LEVELS = ("token", "sequence", "geometric", "any_step")


def _bounded_weight(log_ratio: torch.Tensor, level: str) -> torch.Tensor:
    """[B, W] exp of the clamped log-ratio per step (token), of its sum over the sample's steps
    (sequence: the product of the step ratios) or of its mean (geometric), broadcast to [B, W]."""
    if level in ("token", "any_step"):
        return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    pooled = log_ratio.sum(1, keepdim=True) if level == "sequence" else log_ratio.mean(1, keepdim=True)
    return torch.exp(pooled.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)


def rejection_bounds(lower: float | None, upper: float | None) -> tuple[float, float]:
    """verl's convention: with only an upper bound the lower one is its reciprocal."""
    hi = float("inf") if upper is None else upper
    lo = lower if lower is not None else (1.0 / upper if upper is not None else 0.0)
    return lo, hi


def rollout_correction_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *,
                               step_indices: torch.Tensor | None = None, threshold: float = 2.0,
                               is_level: str = "token", lower: float | None = None, upper: float | None = None,
                               rs_level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights per sample-step, w = min(exp(clamp(log r)), threshold) with
    log r = logp_old - logp_rollout per step (`is_level` token) or summed over the sample's steps
    (sequence).

    With `lower`/`upper` (lower defaults to 1/upper), rejection sets w = 0 where the `rs_level`
    statistic leaves [lower, upper]: the step's own ratio (token), the sample's product of ratios
    (sequence) or their geometric mean (geometric); `any_step` zeroes a whole sample when any of
    its step ratios leaves the bounds. Returns the [B, W] weights and the rollout/train consistency
    metrics; the per-step ones are keyed by the denoising step index (`step_indices` [B, W], the
    schedule position of each stored column), since windows differ between batches and samples.
    """
    diff = (old_log_probs - rollout_log_probs).float()
    raw = _bounded_weight(diff, is_level)
    weights = raw.clamp(max=threshold)
    keep = torch.ones_like(diff, dtype=torch.bool)
    if lower is not None or upper is not None:
        lo, hi = rejection_bounds(lower, upper)
        stat = _bounded_weight(diff, rs_level)
        keep = (stat >= lo) & (stat <= hi)
        if rs_level == "any_step":
            keep = keep.all(dim=1, keepdim=True).expand_as(diff)
        weights = weights * keep.float()
    metrics = {
        "rollout_corr/logp_abs_diff_mean": float(diff.abs().mean()),
        "rollout_corr/logp_abs_diff_max": float(diff.abs().max()),
        "rollout_corr/is_weight_mean": float(weights.mean()),
        "rollout_corr/truncated_frac": float((raw > threshold).float().mean()),
        "rollout_corr/rejected_step_frac": float((~keep).float().mean()),
        "rollout_corr/rejected_sample_frac": float((~keep).any(dim=1).float().mean()),
    }
    if step_indices is None:
        step_indices = torch.arange(diff.shape[1]).expand_as(diff)
    for step in sorted(set(step_indices.reshape(-1).tolist())):
        metrics[f"rollout_corr/logp_abs_diff_step{int(step)}"] = float(diff.abs()[step_indices == step].mean())
    return weights, metrics
