"""Rollout correction: when the policy that sampled a batch differs from the one being trained
(asynchronous rollout, a different inference engine, numerical drift), weight each step by an
importance weight and reject outliers, with verl's options under verl's names (a "token" of verl
is one sample-step of the SDE here, a "sequence" one sample's trained steps).

log r = logp_old - logp_rollout per step (log(pi_train / pi_rollout)), clamped to +-20 before any
exp (verl's SAFETY_BOUND). Importance weights (`rollout_is`): token exp(log r) or sequence
exp(sum log r) on every step of the sample; a threshold `hi` truncates them at hi (TIS), `lo_hi`
zeroes them outside [lo, hi] (IcePop); optionally divided by their batch mean.

Rejection (`rollout_rs`, comma-separated criteria that must all pass) takes rejected steps out of
the step mask, so they leave the loss mean, the KL and the metrics, as verl removes them from its
response mask. Per-step statistics k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r;
`token_kN` judges each step, `seq_sum_kN` / `seq_mean_kN` / `seq_max_kN` the sum, mean or max over
the sample's steps and keep or reject the whole sample. k1 criteria keep lo <= stat <= hi on the
log scale of a `lo_hi` ratio spec (`hi` alone: lo = 1 / hi); k2 and k3 keep stat <= hi.

Older names, still accepted: `token`, `sequence`, `geometric` (verl's before 2025-12: the step
ratio, the sample's product, its geometric mean, within ratio bounds [lower, upper]) are
token_k1, seq_sum_k1 and seq_mean_k1; `any_step` (pixelrl's own) rejects the whole sample when any
step's ratio leaves the bounds; `algorithm.rollout_rs_lower` / `rollout_rs_upper` give those
bounds (lower defaults to 1 / upper) when `rollout_rs_threshold` is not set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pixelrl.core.errors import ConfigError

# exp(+-20): the log-ratio is clamped before exponentiating, as verl does, so one far-off step
# cannot overflow a weight or a sequence product
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "any_step")
# the rejection levels of verl before 2025-12 (ratio bounds), as the criteria that replaced them
OLDER_RS_NAMES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def _ratio_bounded(name: str) -> bool:
    """k1 criteria (and the older names and any_step) bound a ratio on both sides; k2 and k3 bound a
    divergence from above."""
    return name.endswith("k1") or name == "any_step" or name in OLDER_RS_NAMES


@dataclass(frozen=True)
class Criterion:
    """One rejection criterion: k1 options (and any_step) keep log_lower <= stat <= log_upper,
    the others stat <= upper."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def k1(self) -> bool:
        return _ratio_bounded(self.option)


def _positive_number(field: str, text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(field, text, f"option `{option}` takes a positive number (or `lower_upper` for k1 "
                          "criteria), e.g. 2.0 or 0.5_2.0") from None
    if not value > 0:
        raise ConfigError(field, text, f"option `{option}` takes positive bounds")
    return value


def _is_list(value) -> bool:
    """A YAML list, as the config hands it over (OmegaConf's ListConfig) or a plain one."""
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"


def _spec_text(spec) -> str:
    """A bound spec as text: a number, a `lower_upper` string, or a [lower, upper] list. (YAML reads
    some `lower_upper` strings as one number, 0.5_2 as 0.52: a list, or a point in each half as in
    0.5_2.0, avoids that.)"""
    if _is_list(spec):
        return "_".join(str(v) for v in spec)
    return str(spec).strip()


def rejection_criteria(rollout_rs, threshold, lower: float | None = None,
                       upper: float | None = None) -> tuple[Criterion, ...]:
    """The criteria `algorithm.rollout_rs` asks for, with their bounds from `rollout_rs_threshold`
    (one spec for all, or one per criterion, comma-separated) or, for the older names, from
    `rollout_rs_lower` / `rollout_rs_upper`. No rollout_rs, or an older name without bounds: none."""
    if rollout_rs is None or not str(rollout_rs).strip():
        return ()
    names = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    older = [n for n in names if n in OLDER_RS_NAMES]
    unknown = [n for n in names if n not in RS_OPTIONS and n not in OLDER_RS_NAMES]
    if unknown:
        raise ConfigError("algorithm.rollout_rs", rollout_rs, f"unknown criterion {unknown[0]!r}: choose from "
                          f"{list(RS_OPTIONS)} (comma-separated, all must pass) or an older name "
                          f"{list(OLDER_RS_NAMES)}")
    if older and len(names) > 1:
        raise ConfigError("algorithm.rollout_rs", rollout_rs, f"the older name {older[0]!r} stands alone; chain "
                          f"criteria under their current names ({OLDER_RS_NAMES[older[0]]}, ...)")
    if threshold is None:
        if lower is None and upper is None:
            if older or names == ["any_step"]:
                return ()  # pixelrl's older default: a level named, no bounds, no rejection
            raise ConfigError("algorithm.rollout_rs_threshold", None, f"rejection with {names} needs bounds: "
                              "e.g. algorithm.rollout_rs_threshold=0.5_2.0 (k1) or 0.01 (k2, k3)")
        hi = math.inf if upper is None else float(upper)
        lo = float(lower) if lower is not None else (1.0 / hi if upper is not None else 0.0)
        if not all(_ratio_bounded(n) for n in names):
            raise ConfigError("algorithm.rollout_rs_upper", upper, "the ratio bounds rollout_rs_lower / upper serve "
                              "k1 criteria; give k2 and k3 criteria algorithm.rollout_rs_threshold")
        # ratio bounds lo <= r <= hi are k1 = -log r bounds 1/hi <= exp(k1) <= 1/lo
        return tuple(Criterion(OLDER_RS_NAMES.get(n, n), 1.0 / lo if lo > 0 else math.inf, 1.0 / hi)
                     for n in names)
    listed = _is_list(threshold)
    if listed and len(names) == 1 and len(threshold) == 2 and not any(isinstance(v, str) for v in threshold):
        threshold = [threshold]  # one criterion's [lower, upper]
    specs = [_spec_text(part) for part in threshold] if listed else \
        [part.strip() for part in str(threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ConfigError("algorithm.rollout_rs_threshold", threshold, f"give one spec for all {len(names)} "
                          "criteria or one each, comma-separated (or a list) in the order of algorithm.rollout_rs")
    specs = specs * len(names) if len(specs) == 1 else specs
    criteria = []
    for name, spec in zip(names, specs):
        option = OLDER_RS_NAMES.get(name, name)
        field = "algorithm.rollout_rs_threshold"
        if _ratio_bounded(option):
            lo_text, _, hi_text = spec.partition("_") if "_" in spec else ("", "", spec)
            hi = _positive_number(field, hi_text, option)
            lo = _positive_number(field, lo_text, option) if lo_text else 1.0 / hi
            if lo > hi:
                raise ConfigError(field, spec, f"the lower bound of `{option}` is above its upper bound: every "
                                  "sample-step would be rejected; give lower_upper with lower <= upper (a lone "
                                  "bound is the upper one, >= 1; YAML reads 0.5_2 as 0.52: write 0.5_2.0)")
            criteria.append(Criterion(option, hi, lo))
        else:
            if "_" in spec:
                raise ConfigError(field, spec, f"option `{option}` takes one upper bound, without `_`")
            criteria.append(Criterion(option, _positive_number(field, spec, option)))
    return tuple(criteria)


def importance_threshold(spec) -> tuple[float, float | None]:
    """`algorithm.rollout_is_threshold`: a number (or `hi`) truncates at hi; `lo_hi` zeroes the
    weights outside [lo, hi] (IcePop). Returns (hi, lo or None)."""
    field = "algorithm.rollout_is_threshold"
    if isinstance(spec, bool):
        raise ConfigError(field, spec, "a positive number (truncation) or `lower_upper` (IcePop), e.g. 2.0 or 0.5_5.0")
    text = _spec_text(spec)
    lo_text, _, hi_text = text.partition("_") if "_" in text else ("", "", text)
    hi = _positive_number(field, hi_text, "rollout_is")
    if not lo_text:
        return hi, None
    lo = _positive_number(field, lo_text, "rollout_is")
    if lo > hi:
        raise ConfigError(field, spec, "the IcePop band's lower bound is above its upper bound")
    return hi, lo


def _statistic(option: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """[B, W] the criterion's statistic, per step (token_*) or per sample broadcast over its steps."""
    kind, estimator = option.rsplit("_", 1)
    per_step = {"k1": -log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": torch.exp(log_ratio) - 1.0 - log_ratio}[estimator]
    if kind == "token":
        return per_step
    pooled = {"seq_sum": per_step.sum(1), "seq_mean": per_step.mean(1), "seq_max": per_step.max(1).values}[kind]
    return pooled.unsqueeze(1).expand_as(log_ratio)


def rejection_keep(log_ratio: torch.Tensor, criteria: tuple[Criterion, ...]) -> tuple[torch.Tensor, dict]:
    """[B, W] True where every criterion keeps the sample-step; each criterion's masked fraction."""
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    metrics = {}
    for c in criteria:
        stat = _statistic("token_k1" if c.option == "any_step" else c.option, log_ratio)
        if c.k1:
            kept = (stat >= (math.log(c.lower) if c.lower > 0 else -math.inf)) & (stat <= math.log(c.upper))
        else:
            kept = stat <= c.upper
        if c.option == "any_step":
            kept = kept.all(dim=1, keepdim=True).expand_as(log_ratio)
        metrics[f"rollout_corr/rollout_rs_{c.option}_masked_fraction"] = float((~kept).float().mean())
        keep &= kept
    return keep, metrics


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *,
                       step_indices: torch.Tensor | None = None, is_level: str = "token", is_threshold=2.0,
                       is_batch_normalize: bool = False, criteria: tuple[Criterion, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The [B, W] importance weights, the [B, W] step mask (1 kept, 0 rejected) and the
    rollout/train consistency metrics; the per-step ones are keyed by the denoising step index
    (`step_indices` [B, W], the schedule position of each stored column), since windows differ
    between batches and samples. The weights are not masked: the loss leaves rejected steps out."""
    diff = (old_log_probs - rollout_log_probs).float()
    log_ratio = diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    pooled = log_ratio if is_level == "token" else log_ratio.sum(1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    raw = torch.exp(pooled).expand_as(diff)
    hi, lo = importance_threshold(is_threshold)
    weights = raw.clamp(max=hi) if lo is None else torch.where((raw >= lo) & (raw <= hi), raw, torch.zeros_like(raw))
    keep, metrics = rejection_keep(log_ratio, criteria)
    metrics.update({
        "rollout_corr/logp_abs_diff_mean": float(diff.abs().mean()),
        "rollout_corr/logp_abs_diff_max": float(diff.abs().max()),
        "rollout_corr/is_weight_mean": float(weights.mean()),
        "rollout_corr/truncated_frac": float((raw > hi).float().mean()),
        "rollout_corr/rejected_step_frac": float((~keep).float().mean()),
        "rollout_corr/rejected_sample_frac": float((~keep).any(dim=1).float().mean()),
    })
    if lo is not None:
        metrics["rollout_corr/is_oob_frac"] = float(((raw < lo) | (raw > hi)).float().mean())
    if is_batch_normalize:  # verl: to mean 1 over the whole batch (per sample at sequence level)
        mean = weights.mean() if is_level == "token" else weights[:, 0].mean()
        if float(mean) > 1e-8:
            weights = weights / mean
        metrics["rollout_corr/is_batch_norm_factor"] = float(mean) if float(mean) > 1e-8 else 1.0
    if step_indices is None:
        step_indices = torch.arange(diff.shape[1]).expand_as(diff)
    for step in sorted(set(step_indices.reshape(-1).tolist())):
        metrics[f"rollout_corr/logp_abs_diff_step{int(step)}"] = float(diff.abs()[step_indices == step].mean())
    return weights, keep.float(), metrics
