"""Algorithms: advantage estimators and losses as pure tensor functions in registries."""

from pixelrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages, group_reward_stats,
)
from pixelrl.algos.losses import LOSSES, LossSpec, get_loss, register_loss, require_keys
from pixelrl.algos import dgpo, distillation, distribution_matching, forward_process, supervised  # noqa: F401  (registers their losses)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "get_advantage_estimator", "group_advantages", "group_reward_stats",
    "LOSSES", "LossSpec", "get_loss", "register_loss", "require_keys",
]
