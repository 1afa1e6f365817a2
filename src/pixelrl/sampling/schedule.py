"""Sigma schedules: by default the model family's own (its diffusers scheduler, shift included); the
DanceGRPO / MixGRPO recipes shift an evenly spaced grid themselves (`linspace_shift`); DGPO samples
and trains on DPM-Solver's flow-sigma grid (`dpm_flow`)."""

from __future__ import annotations

import torch

from pixelrl.models.base import sigmas_from_scheduler  # noqa: F401  (re-exported: pixelrl.sampling)

SIGMA_SCHEDULES = ("scheduler", "linspace_shift", "dpm_flow")


def time_shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching time shift t -> shift t / (1 + (shift - 1) t) (SD3's, with shift 3)."""
    return shift * t / (1 + (shift - 1) * t)


def linspace_shift_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """DanceGRPO / MixGRPO: sigma = shift s / (1 + (shift - 1) s) for s = linspace(1, 0, N + 1).

    Unlike the diffusers scheduler (whose grid ends at 1 / num_train_timesteps before the final
    0), the grid reaches 0 evenly: for shift 3 and N = 10 the two differ by up to 0.24."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return time_shift(s, shift).to(torch.float32)


def dpm_flow_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """DGPO's grid: diffusers' `DPMSolverMultistepScheduler` with `use_flow_sigmas` and `flow_shift`,
    sigma = shift s / (1 + (shift - 1) s) for s = 1 - linspace(1, 1/1000, N + 1) reversed, its
    last (0) replaced by the final 0 (shift 3, N = 10: 0.99967, 0.9639, ..., 0.2498, 0). The
    reference conditions the model on the scheduler's integer timesteps (floor(1000 sigma)) where
    pixelrl passes sigma itself: at most 1e-3 apart."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction")
    scheduler.set_timesteps(num_steps, device="cpu")
    return scheduler.sigmas.to(torch.float32)


def schedule_sigmas(model, num_steps: int, kind: str, height: int, width: int, shift: float = 0.0) -> torch.Tensor:
    """The N + 1 sigmas of the configured schedule (`rollout.sigma_schedule`) for `model` at this
    resolution: its family's own (dynamic shift included) or a grid shifted by `shift`
    (`rollout.sigma_shift`; 0: the family scheduler's shift)."""
    if kind == "scheduler":
        return model.sigmas(num_steps, height, width)
    shift = shift or float(model.scheduler.config.get("shift", 1.0))
    if kind == "linspace_shift":
        return linspace_shift_sigmas(num_steps, shift)
    if kind == "dpm_flow":
        return dpm_flow_sigmas(num_steps, shift)
    from pixelrl.core.errors import ConfigError

    raise ConfigError("rollout.sigma_schedule", kind, f"choose one of {list(SIGMA_SCHEDULES)}")
