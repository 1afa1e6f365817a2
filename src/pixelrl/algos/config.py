"""The `algorithm:` and `diffusion_loss:` sections: which trainer family, how rewards become
advantages, how stale samples are corrected, and which loss with which params."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pixelrl.core.errors import ConfigError, check_choice, check_number


@dataclass
class DiffusionLossConfig:
    name: str = "flow_grpo"
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0  # beta of the KL to the reference policy
    kl_type: str = "reference"  # reference | exact
    # On-policy distillation toward a frozen teacher (docs/algorithms/opd.md), read by the
    # `distill_kl` loss, or with distill_coef > 0 as a term beside another transition loss:
    # `base` (the model with its adapters off), a folder holding a LoRA of the base, a checkpoint
    # (LoRA or full fine-tune) or a pipeline folder of a fine-tune of it, or {data_source: any of
    # those, "*": the rest} to route each prompt's samples to its dataset's teacher
    teacher: Any = "base"
    # transition: divide by the variance the step samples with (the true KL, Flow-Factory);
    # scheduler: by the scheduler's sigma_t^2 (verl-omni)
    distill_variance: str = "transition"
    distill_coef: float = 0.0  # > 0: + coef x distill_kl beside a transition loss (verl-omni's distill_loss_coef)
    # Options of the chosen loss only (its params dataclass in pixelrl.algos), e.g. flow_dppo: {tau: 1e-5}
    params: dict = field(default_factory=dict)

    def check(self):
        """The loss's name and shared numbers; returns its params, bound and checked by the loss."""
        from pixelrl.algos.kl import KL_TYPES
        from pixelrl.algos.losses import LOSSES

        check_choice("diffusion_loss.name", self.name, LOSSES.names())
        bound = LOSSES.get(self.name).bind(self)
        # an infinite clip = no clipping
        check_number("diffusion_loss.clip_ratio", self.clip_ratio, allow_inf=True)
        check_number("diffusion_loss.adv_clip_max", self.adv_clip_max, allow_inf=True)
        check_number("diffusion_loss.kl_coef", self.kl_coef, allow_zero=True)
        check_choice("diffusion_loss.kl_type", self.kl_type, KL_TYPES)
        self._check_distillation()
        return bound

    def _check_distillation(self) -> None:
        from pixelrl.algos.distillation import DISTILL_VARIANCES, teacher_routes

        check_choice("diffusion_loss.distill_variance", self.distill_variance, DISTILL_VARIANCES)
        check_number("diffusion_loss.distill_coef", self.distill_coef, allow_zero=True)
        teacher_routes(self.teacher)  # a string or a mapping of strings, each named
        if self.distill_coef > 0 and self.name == "distill_kl":
            raise ConfigError("diffusion_loss.distill_coef", self.distill_coef, "distill_kl is the whole loss already: "
                              "set distill_coef=0, or name the policy loss it is to sit beside (e.g. flow_grpo)")


# algorithm.trainer_type's names before 2026-11 -> the current ones (configs using them still run)
TRAINER_TYPE_ALIASES = {"policy_gradient": "transition", "direct_preference": "forward_process"}


@dataclass
class TrainerTypeConfig:
    """What every trainer's `algorithm:` section holds: which trainer runs."""

    # How the update sees a sample. transition: re-scores the sampler's SDE transitions
    # (Flow-GRPO family); forward_process: re-noises the clean sample at drawn timesteps
    # (Diffusion-DPO, DiffusionNFT, AWM, DGPO). vlm_ppo: the vision-language trainer. The names before
    # 2026-11, policy_gradient and direct_preference, still load (TRAINER_TYPE_ALIASES).
    trainer_type: str = "transition"


@dataclass
class AlgorithmConfig(TrainerTypeConfig):
    """The diffusion trainers' `algorithm:` section: advantages, filters, rollout correction."""

    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    global_std: bool = True  # std of the whole batch (Flow-GRPO) or of each group (DanceGRPO, MixGRPO)
    adv_std_unbiased: bool = False  # ddof 1 (DanceGRPO, MixGRPO) instead of the population std
    adv_eps: float = 1e-4  # A = (r - mean) / (std + adv_eps); DanceGRPO and MixGRPO use 1e-8
    # Flow-GRPO drops samples whose advantage is exactly 0 before training (re-adding random
    # dropped ones until the count splits into the mini-batches and workers); verl-omni keeps them,
    # which raises the effective KL weight by 1 / (1 - zero fraction). DiffusionNFT and AWM honour
    # it too (AWM's zero-advantage samples carry only its reference and EMA terms); DPO trains pairs.
    drop_zero_advantage: bool = True
    rollout_correction: str = "bypass"  # bypass | decoupled
    # decoupled: importance weights per sample-step (token) or of the sample's product (sequence),
    # truncated at rollout_is_threshold (a number) or zeroed outside it (`lower_upper`: IcePop),
    # optionally divided by their batch mean; verl's names and specs (pixelrl.algos.rollout_correction)
    rollout_is: str = "token"
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    # decoupled: rejection criteria, comma-separated, all must pass (token_k1, seq_mean_k1, seq_max_k2,
    # ...), with their bounds (`lower_upper` for k1, an upper bound for k2 / k3; one spec or one per
    # criterion); a rejected sample-step leaves the loss mean, the KL and the metrics. The older
    # names token / sequence / geometric / any_step take ratio bounds rollout_rs_lower / upper
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    rollout_rs_lower: float | None = None
    rollout_rs_upper: float | None = None
    # Several rewards: `sum_rewards` normalises sum_k w_k r_k; `sum_advantages` (MixGRPO's
    # advantage_aggr) normalises each reward separately and sums w_k A_k; `gdpo` (Flow-Factory's)
    # normalises each reward within its group (population std, floor 1e-6), sums w_k of them and
    # standardises the sum over the batch (adv_estimator, global_std and adv_eps are not read).
    reward_aggregation: str = "sum_rewards"
    # forward_process only: `online` samples and scores pairs each step; `offline` (Diffusion-DPO)
    # reads (prompt, chosen, rejected) rows from data.train_files (see pixelrl.data.preferences)
    sample_source: str = "online"

    def check(self) -> None:
        """Everything but trainer_type, which the config's composer checks against the trainers."""
        from pixelrl.algos.advantages import ADVANTAGE_ESTIMATORS

        check_number("algorithm.adv_eps", self.adv_eps)
        check_choice("algorithm.adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATORS.names())
        check_choice("algorithm.rollout_correction", self.rollout_correction, ("bypass", "decoupled"))
        self._check_rollout_correction()
        check_choice("algorithm.reward_aggregation", self.reward_aggregation, ("sum_rewards", "sum_advantages", "gdpo"))
        check_choice("algorithm.sample_source", self.sample_source, ("online", "offline"))

    def _check_rollout_correction(self) -> None:
        from pixelrl.algos.rollout_correction import IS_LEVELS, importance_threshold

        check_choice("algorithm.rollout_is", self.rollout_is, IS_LEVELS)
        importance_threshold(self.rollout_is_threshold)
        for name in ("rollout_rs_lower", "rollout_rs_upper"):
            if getattr(self, name) is not None:
                check_number(f"algorithm.{name}", getattr(self, name), allow_zero=name == "rollout_rs_lower")
        if self.rollout_rs_lower is not None and self.rollout_rs_upper is not None \
                and self.rollout_rs_lower > self.rollout_rs_upper:
            raise ConfigError("algorithm.rollout_rs_lower", self.rollout_rs_lower, f"is above algorithm.rollout_rs_upper "
                              f"({self.rollout_rs_upper}): every sample-step would be rejected; set lower <= upper")
        self.rejection_criteria()

    def rejection_criteria(self):
        """The rollout-correction rejection criteria, parsed (ConfigError naming the field)."""
        from pixelrl.algos.rollout_correction import rejection_criteria

        return rejection_criteria(self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_lower,
                                  self.rollout_rs_upper)
