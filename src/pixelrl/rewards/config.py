"""The `reward:` section: which reward functions score a step, where they run, and what a
failing one does to the run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pixelrl.core.errors import ConfigError, check_choice, check_number


@dataclass
class RewardFunctionsConfig:
    """What every trainer's `reward:` section holds: the weighted reward functions."""

    # Each entry: {name: <registered reward>, weight: float, options: {...}}.
    functions: list[dict] = field(default_factory=lambda: [{"name": "jpeg_compressibility", "weight": 1.0}])
    # the most seconds one reward function may take for one call (a step's or a validation's
    # samples), in the process that scores: past it the call fails like a reward that raised
    # (the diffusion trainers' on_error decides); 0 = no deadline. The call's thread is left to finish on its own.
    timeout_s: float = 900.0

    def check(self) -> None:
        if not self.functions:
            raise ConfigError("reward.functions", self.functions, "list at least one reward")
        check_number("reward.timeout_s", self.timeout_s, allow_zero=True)  # 0 = no deadline
        check_reward_specs("reward.functions", self.functions)
        if all(spec.get("weight", 1.0) == 0 for spec in self.functions):
            raise ConfigError("reward.functions[].weight", [spec.get("weight", 1.0) for spec in self.functions],
                              "every training reward is weighted 0, so every advantage is 0 and nothing trains: "
                              "give at least one reward a non-zero weight")


@dataclass
class RewardConfig(RewardFunctionsConfig):
    """The diffusion trainers' `reward:` section: the functions, where they run, and what a
    failing one does to the run."""

    placement: str = "colocated"  # colocated (shares the actor's resources) | pool (its own resources)
    num_workers: int = 1
    num_cpus: float = 1.0  # per reward worker when placement = pool
    num_gpus: float = 0.0  # per reward worker when placement = pool: a reward model's own GPU (Ray clusters)
    # A scorer that fails (raises, times out, returns non-finite scores): `stop` the run, or
    # `skip` the step (no update, `reward/error` = 1 in its row) until max_consecutive_errors in a row
    on_error: str = "stop"
    max_consecutive_errors: int = 3

    def check_resources(self) -> None:
        """Where the scorers run (the diffusion trainers' reward pool)."""
        check_choice("reward.placement", self.placement, ("colocated", "pool"))
        check_choice("reward.on_error", self.on_error, ("stop", "skip"))
        check_number("reward.max_consecutive_errors", self.max_consecutive_errors)
        check_number("reward.num_cpus", self.num_cpus)
        check_number("reward.num_gpus", self.num_gpus, allow_zero=True)
        check_number("reward.num_workers", self.num_workers)


def check_reward_specs(field_name: str, specs) -> None:
    """Each entry of a reward list ({name, weight, options}) names a registered reward, with a
    modest finite weight and only options that reward takes."""
    from pixelrl.rewards.registry import REWARDS, check_reward_options

    for i, spec in enumerate(specs):
        if not hasattr(spec, "keys") or "name" not in spec:
            raise ConfigError(f"{field_name}[{i}]", spec, "each reward is a mapping with a `name`")
        unknown = set(spec) - {"name", "weight", "options"}
        if unknown:
            raise ConfigError(f"{field_name}[{i}]", dict(spec), f"unknown keys {sorted(unknown)}; use name, weight, options")
        REWARDS.get(spec["name"], field=f"{field_name}[{i}].name")  # unknown: the registry's error and plugins hint
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or abs(weight) > 1e6:
            raise ConfigError(f"{field_name}[{i}].weight", weight, "must be a finite number of modest size "
                              "(|weight| <= 1e6; the weighted sum is taken in float32)")
        check_reward_options(spec["name"], dict(spec.get("options") or {}), f"{field_name}[{i}].options")
