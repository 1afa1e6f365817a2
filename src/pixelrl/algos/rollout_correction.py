"""Rollout correction: when the policy that sampled a batch differs from the one being trained
(asynchronous rollout, a different inference engine, numerical drift), re-weight each step."""

from __future__ import annotations

import torch


def rollout_correction_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *,
                               step_indices: torch.Tensor | None = None, threshold: float = 2.0,
                               lower: float | None = None,
                               upper: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights per sample-step, w = min(exp(logp_old - logp_rollout), threshold).

    With `lower`/`upper`, a sample any of whose step weights (before truncation) leaves
    [lower, upper] is rejected: all its weights become 0. Returns the [B, W] weights and the
    rollout/train consistency metrics; the per-step ones are keyed by the denoising step index
    (`step_indices` [B, W], the schedule position of each stored column), since windows differ
    between batches and samples.
    """
    diff = (old_log_probs - rollout_log_probs).float()
    raw = torch.exp(diff)
    weights = raw.clamp(max=threshold)
    rejected = torch.zeros(raw.shape[0], dtype=torch.bool)
    if lower is not None or upper is not None:
        lo = -float("inf") if lower is None else lower
        hi = float("inf") if upper is None else upper
        rejected = ((raw < lo) | (raw > hi)).any(dim=1)
        weights = weights * (~rejected).float().unsqueeze(1)
    metrics = {
        "rollout_corr/logp_abs_diff_mean": float(diff.abs().mean()),
        "rollout_corr/logp_abs_diff_max": float(diff.abs().max()),
        "rollout_corr/is_weight_mean": float(weights.mean()),
        "rollout_corr/truncated_frac": float((raw > threshold).float().mean()),
        "rollout_corr/rejected_frac": float(rejected.float().mean()),
    }
    if step_indices is None:
        step_indices = torch.arange(diff.shape[1]).expand_as(diff)
    for step in sorted(set(step_indices.reshape(-1).tolist())):
        metrics[f"rollout_corr/logp_abs_diff_step{int(step)}"] = float(diff.abs()[step_indices == step].mean())
    return weights, metrics
