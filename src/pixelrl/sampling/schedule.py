"""Sigma schedules: by default the model's own diffusers scheduler (shift included); the
DanceGRPO / MixGRPO recipes shift an evenly spaced grid themselves (`linspace_shift`)."""

from __future__ import annotations

import copy

import torch


def sigmas_from_scheduler(scheduler, num_steps: int, image_seq_len: int | None = None) -> torch.Tensor:
    """The N + 1 sigmas (ending in 0) that `scheduler` uses for `num_steps` steps.

    The scheduler is copied so that callers never mutate the model's own instance. Schedulers
    with resolution-dependent shifting (FLUX) need `image_seq_len` to compute `mu`.
    """
    sched = copy.deepcopy(scheduler)
    kwargs = {}
    if getattr(sched.config, "use_dynamic_shifting", False):
        if image_seq_len is None:
            raise ValueError("this scheduler shifts by resolution: pass image_seq_len")
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = sched.config
        kwargs["mu"] = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    sched.set_timesteps(num_steps, device="cpu", **kwargs)
    sigmas = sched.sigmas.detach().to(torch.float32).cpu()
    if sigmas.shape[0] != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"expected {num_steps + 1} sigmas ending in 0 from the scheduler, got {sigmas.tolist()}")
    return sigmas



SIGMA_SCHEDULES = ("scheduler", "linspace_shift")


def linspace_shift_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """DanceGRPO / MixGRPO: sigma = shift s / (1 + (shift - 1) s) for s = linspace(1, 0, N + 1).

    Unlike the diffusers scheduler (whose grid ends at 1 / num_train_timesteps before the final
    0), the grid reaches 0 evenly: for shift 3 and N = 10 the two differ by up to 0.24."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).to(torch.float32)


def schedule_sigmas(scheduler, num_steps: int, kind: str = "scheduler") -> torch.Tensor:
    """The N + 1 sigmas of the configured schedule (`rollout.sigma_schedule`)."""
    if kind == "scheduler":
        return sigmas_from_scheduler(scheduler, num_steps)
    if kind == "linspace_shift":
        return linspace_shift_sigmas(num_steps, float(scheduler.config.get("shift", 1.0)))
    from pixelrl.core.errors import ConfigError

    raise ConfigError("rollout.sigma_schedule", kind, f"choose one of {list(SIGMA_SCHEDULES)}")
