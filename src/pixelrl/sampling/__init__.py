"""Sampling: sigma schedules, SDE steps with log-probs, windows and the rollout loop."""

from pixelrl.sampling.rollout import RolloutOutput, SamplingSettings, rollout, step_with_log_prob
from pixelrl.sampling.schedule import sigmas_from_scheduler
from pixelrl.sampling.sde import SDE_RULES, SdeRule, StepOutput, register_sde_rule, sde_step
from pixelrl.sampling.windows import Window, choose_window, full_window, random_window

__all__ = [
    "RolloutOutput", "SamplingSettings", "rollout", "step_with_log_prob", "sigmas_from_scheduler",
    "SDE_RULES", "SdeRule", "StepOutput", "register_sde_rule", "sde_step", "Window", "choose_window", "full_window", "random_window",
]
