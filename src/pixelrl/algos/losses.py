"""Losses for flow-matching policies (pure tensor functions) and their registry.

A loss names its objective, the engine path that turns a micro-batch into its inputs:
`transition` (re-score stored SDE window steps: one call per trained step, inputs are
log-probs, step means and advantages) or `forward_process` (noise a clean sample at a sampled
timestep: inputs are velocities of the policy and, on request, the reference and the old
policy). It returns (scalar loss, metrics) and declares `batch_keys` (what the batch must carry)
and `step_keys` (what it reads from the step dict); a missing key names the loss, the missing
keys and the available ones. Options specific to one loss live in its own params dataclass,
set in the config under `diffusion_loss.params` and validated at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterable

import torch

from pixelrl.core.errors import ConfigError, MissingBatchKeysError
from pixelrl.algos.methods import MethodSpec, method_of_loss, register_method
from pixelrl.core.registry import Registry
from pixelrl.sampling.sde import mean_over_dims

LOSSES: Registry = Registry("loss", "diffusion_loss.name")
# step keys computed by a forward of the reference policy (AWM's and NFT's v_ref, Diffusion-DPO's errors)
REFERENCE_STEP_KEYS = frozenset({"v_ref", "ref_err_chosen", "ref_err_rejected"})
# Fields of `diffusion_loss` every transition loss reads (the rest of a loss's options are its params).
SHARED_FIELDS = ("clip_ratio", "adv_clip_max", "kl_coef", "kl_type", "teacher", "distill_variance", "distill_coef")


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable
    batch_keys: tuple[str, ...]
    step_keys: tuple[str, ...]
    objective: str = "transition"  # the method family it trains under (`algos.methods.METHODS`)
    params: type | None = None  # the loss's own options (a dataclass), or None
    # The loss and its metrics are means of per-sample-step terms (no statistic across the
    # batch), so several window steps of a micro-batch may share one forward
    # (actor.window_steps_per_forward) with the same gradient up to float reordering.
    steps_batchable: bool = False
    # step keys whose term a param can switch off: {step key: param}; when the param is 0 the
    # engine passes None for the key and skips the forward that would compute it
    weighted_step_keys: tuple[tuple[str, str], ...] = ()
    # the loss takes statistics over each prompt group (DGPO): a micro-batch must hold whole
    # groups, so the engine shuffles groups rather than samples (the config checks the sizes)
    whole_groups: bool = False

    def step_keys_needed(self, options) -> tuple[str, ...]:
        """The step keys this loss reads under `options` (from `bind`): all of `step_keys` but
        those whose weighting param is 0."""
        off = {key for key, param in self.weighted_step_keys if getattr(options, param) == 0}
        return tuple(k for k in self.step_keys if k not in off)

    def reads_reference(self, options) -> bool:
        """Whether training under `options` needs the reference policy: the KL term, or a step key
        of the loss that a reference forward computes."""
        return options.kl_coef > 0 or bool(REFERENCE_STEP_KEYS.intersection(self.step_keys_needed(options)))

    def reads_teacher(self, options) -> bool:
        """Whether training under `options` reads a distillation teacher: the loss reads its means
        (distill_kl), a distill_coef term sits beside it, or its method always does (DMD2)."""
        return (method_of_loss(self).reads_teacher or "teacher_mean" in self.step_keys
                or getattr(options, "distill_coef", 0) > 0)

    @property
    def trains_on_pairs(self) -> bool:
        """A preference loss (Diffusion-DPO): it trains on (chosen, rejected) clean pairs, one per
        prompt, made from each group's best and worst sample or read from an offline data set."""
        return "x0_rejected" in self.batch_keys

    @property
    def reads_advantages(self) -> bool:
        """The loss reads each sample's advantage, or the group ranking its pairs are made from."""
        return "advantages" in self.step_keys or self.trains_on_pairs

    def __call__(self, step: dict, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        require_keys(f"loss `{self.name}`", self.step_keys, step.keys())
        return self.fn(step, cfg)

    def bind(self, loss_cfg) -> SimpleNamespace:
        """The options this loss is called with: the shared `diffusion_loss` fields plus its own
        params (defaults overridden by `diffusion_loss.params`), checked here."""
        given = dict(getattr(loss_cfg, "params", None) or {})
        own = {}
        if self.params is None:
            if given:
                raise ConfigError("diffusion_loss.params", given, f"loss `{self.name}` takes no params")
        else:
            known = {f.name for f in dataclasses.fields(self.params)}
            unknown = sorted(set(given) - known)
            if unknown:
                raise ConfigError("diffusion_loss.params", given,
                                  f"loss `{self.name}` has no param(s) {unknown}; known: {sorted(known)}")
            for f in dataclasses.fields(self.params):
                if f.name in given:
                    _check_param_kind(f, given[f.name])
            own = dataclasses.asdict(self.params(**given))
        shared = {k: getattr(loss_cfg, k) for k in SHARED_FIELDS if hasattr(loss_cfg, k)}
        return SimpleNamespace(**shared, **own)


def _check_param_kind(f: dataclasses.Field, value) -> None:
    """A `diffusion_loss.params` value of its default's kind (null included), so that a params
    class's own checks compare numbers with numbers and lists with lists."""
    from collections.abc import Mapping, Sequence

    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if default is None:
        return
    kinds = [(bool, "true or false", lambda v: isinstance(v, bool)),
             (int, "a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
             (float, "a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
             (str, "a string", lambda v: isinstance(v, str)),
             (Sequence, "a list", lambda v: isinstance(v, Sequence) and not isinstance(v, str)),
             (Mapping, "a mapping", lambda v: isinstance(v, Mapping))]
    for kind, words, fits in kinds:
        if isinstance(default, kind):
            if not fits(value):
                shown = str(default).lower() if isinstance(default, bool) else repr(default)  # as YAML spells it
                raise ConfigError(f"diffusion_loss.params.{f.name}", value, f"must be {words} (default: {shown}); "
                                  "remove the override to keep the default")
            return


# The Flow-GRPO family: its losses re-score the rollout's stored SDE transitions
register_method(MethodSpec("transition", rescores_transitions=True))


def require_keys(consumer: str, needed: Iterable[str], available: Iterable[str]) -> None:
    available = set(available)
    missing = [k for k in needed if k not in available]
    if missing:
        raise MissingBatchKeysError(consumer, missing, available)


def register_loss(name: str, *, batch_keys: Iterable[str], step_keys: Iterable[str], aliases: Iterable[str] = (),
                  objective: str = "transition", params: type | None = None, steps_batchable: bool = False,
                  weighted_step_keys: dict[str, str] | None = None, whole_groups: bool = False):
    def decorator(fn: Callable) -> LossSpec:
        spec = LossSpec(name, fn, tuple(batch_keys), tuple(step_keys), objective, params, steps_batchable,
                        tuple((weighted_step_keys or {}).items()), whole_groups)
        LOSSES.register(name, *aliases)(spec)
        return spec

    return decorator


def get_loss(name: str) -> LossSpec:
    return LOSSES.get(name)


def positive(field: str, value: float) -> None:
    """Params dataclasses check their own fields (named as in the config)."""
    if not value > 0:
        raise ConfigError(f"diffusion_loss.params.{field}", value, "must be positive")


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


def kept_mean(values: torch.Tensor, step_mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over the sample-steps rollout correction kept (`step_mask` > 0; all without one)."""
    if step_mask is None:
        return values.float().mean()
    kept = (step_mask > 0).float()
    return (values.float() * kept).sum() / kept.sum().clamp(min=1.0)


def ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, clip_ratio: float,
                  step_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Over the kept sample-steps: rejected ones are out of the metrics, as out of the loss."""
    r = ratio.detach()
    mean = kept_mean(r, step_mask)
    return {
        "clipfrac": kept_mean(((r - 1.0).abs() > clip_ratio).float(), step_mask),
        "approx_kl": kept_mean(0.5 * log_ratio.detach() ** 2, step_mask),
        "ratio_mean": mean,
        "ratio_std": kept_mean((r - mean) ** 2, step_mask).sqrt(),
    }


@register_loss(
    "flow_grpo",
    batch_keys=("latents", "log_probs", "sigmas", "sigmas_next", "advantages"),
    step_keys=("log_prob", "old_log_prob", "advantages"),
    aliases=("dance_grpo",),
    steps_batchable=True,
)
def flow_grpo_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """Flow-GRPO: clipped surrogate on per-step Gaussian log-prob ratios (eps = clip_ratio)."""
    log_ratio = step["log_prob"] - step["old_log_prob"]
    loss, ratio = clipped_policy_objective(
        log_ratio, step["advantages"], cfg.clip_ratio, cfg.adv_clip_max, step.get("is_weights")
    )
    return loss, {"pg_loss": loss.detach(), **ratio_metrics(log_ratio, ratio, cfg.clip_ratio, step.get("step_mask"))}


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
    metrics = ratio_metrics(log_ratio, ratio, cfg.clip_ratio, step.get("step_mask"))
    # approx_kl measures how far the policy moved: on the raw log-ratio, as for flow_grpo.
    metrics["approx_kl"] = kept_mean(0.5 * raw_log_ratio.detach() ** 2, step.get("step_mask"))
    return loss, {"pg_loss": loss.detach(), "guard_bias": bias.detach().mean(), **metrics}


@dataclass
class FlowDPPOParams:
    # divergence at which a sample-step that keeps pushing is dropped (UniRL's kl_mask_threshold;
    # one update moves D by ~1e-6 per step, so much larger values never mask)
    tau: float = 1e-5

    def __post_init__(self):
        positive("tau", self.tau)


@register_loss(
    "flow_dppo",
    batch_keys=("latents", "log_probs", "sigmas", "sigmas_next", "advantages", "old_means"),
    step_keys=("log_prob", "old_log_prob", "advantages", "mean", "old_mean", "noise_std"),
    params=FlowDPPOParams,
    steps_batchable=True,
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
    too_far = divergence.detach() >= cfg.tau
    masked_pos = too_far & (ratio > 1) & (adv > 0)
    masked_neg = too_far & (ratio < 1) & (adv < 0)
    keep = (~(masked_pos | masked_neg)).float()
    per_sample = keep * (-adv * ratio)
    if step.get("is_weights") is not None:
        per_sample = per_sample * step["is_weights"].detach()
    loss = per_sample.mean()
    mask = step.get("step_mask")
    return loss, {
        "pg_loss": loss.detach(), **{k: v for k, v in ratio_metrics(log_ratio, ratio, 0.0, mask).items()
                                     if k != "clipfrac"},  # DPPO clips nothing
        "dppo_masked_frac": 1 - kept_mean(keep, mask), "dppo_masked_frac_pos": kept_mean(masked_pos, mask),
        "dppo_masked_frac_neg": kept_mean(masked_neg, mask), "dppo_divergence": kept_mean(divergence.detach(), mask),
    }
