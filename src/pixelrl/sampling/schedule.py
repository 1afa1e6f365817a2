"""Sigma schedules come from the model's own diffusers scheduler (shift included)."""

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

