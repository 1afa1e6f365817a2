"""The start-up size check: a step nobody meant (a typo such as rollout.n=200000) is refused
with its numbers before any worker starts, instead of sampling for hours and then running out of
memory. It uses `pixelrl plan`'s shape and FLOP arithmetic (pixelrl.config.plan)."""

from __future__ import annotations

from pixelrl.algos.methods import method_of
from pixelrl.config.plan import ACHIEVED_FRACTION_OF_PEAK, Choice, estimate, model_shape, step_work
from pixelrl.config.sections import PixelRLConfig
from pixelrl.engine.config import images_per_step
from pixelrl.core.errors import AUTO, ConfigError

MAX_STEP_HOURS = 24.0


class DriverMemoryError(ConfigError):
    """A step larger than this machine's memory: about the machine it is checked on, which a plan
    for other machines notes rather than refuses."""
_CPU_RATE: dict[str, float] = {}


def _this_machines_rate(cfg: PixelRLConfig) -> tuple[float, str]:
    """FLOP/s a step's denoiser work gets: for a GPU the estimate's share of its peak (from
    trainer.peak_tflops, else an H100's 989); on a CPU the measured matmul rate of this process."""
    import torch

    if torch.device(cfg.model.device).type == "cuda":
        peak = cfg.trainer.peak_tflops or 989.0
        return ACHIEVED_FRACTION_OF_PEAK * peak * 1e12, f"{ACHIEVED_FRACTION_OF_PEAK:.0%} of a {peak:g} TFLOP/s GPU"
    from pixelrl.engine.flops import matmul_peak_flops
    from pixelrl.models.base import resolve_dtype

    if cfg.model.dtype not in _CPU_RATE:
        _CPU_RATE[cfg.model.dtype] = matmul_peak_flops("cpu", resolve_dtype(cfg.model.dtype), size=512, repeats=3)
    return _CPU_RATE[cfg.model.dtype], "this CPU's measured matmul rate"


def check_step_size(cfg: PixelRLConfig) -> None:
    """Refuse, with the numbers, a step that cannot be what the user meant (a typo such as
    rollout.n=200000): its decoded images and stored SDE trajectories, which reach the driver,
    larger than this machine's memory; or its denoiser work longer than MAX_STEP_HOURS even at
    full speed. Runs before any worker starts, so hours of sampling are not lost to it."""
    import psutil

    r, images, workers = cfg.rollout, images_per_step(cfg), cfg.trainer.n_workers
    field, value = ("rollout.n", r.n) if r.n >= cfg.data.train_batch_size else ("data.train_batch_size",
                                                                                  cfg.data.train_batch_size)
    fix = "lower rollout.n, data.train_batch_size, rollout.resolution or rollout.num_steps"
    shape, work = model_shape(cfg), step_work(cfg, workers)
    # a transition run keeps the window's float32 latents (W + 1) and the final one per sample
    window = (r.sde_window_size or r.num_steps - 1) if method_of(cfg).rescores_transitions else 0
    sampled = work.sampled_images * workers
    stored = sampled * (shape.frames * shape.pixels * 3 + (window + 2) * shape.latent_values * 4)
    # an oversampling pool's images and clean latents, held until its kept samples are chosen
    stored += work.pool_images * workers * (shape.frames * shape.pixels * 3 + shape.latent_values * 4)
    ram = psutil.virtual_memory().total
    if stored > ram:
        raise DriverMemoryError(field, value, f"a step samples data.train_batch_size x rollout.n = {images} images of "
                          f"{r.resolution} px{f' x {shape.frames} frames' if shape.frames > 1 else ''}; their pixels "
                          f"and stored trajectories take {stored / 1e9:.0f} GB on the driver, more than this "
                          f"machine's {ram / 1e9:.0f} GB of memory: {fix}")
    # `auto` sizes are not chosen yet: the fewest FLOPs (no recompute) bound the step from below
    sized = [1 if v == AUTO else v for v in (cfg.actor.ppo_micro_batch_size, r.micro_batch_size)]
    choice = Choice(sized[0], cfg.model.gradient_checkpointing is True, sized[1])
    flops = estimate(cfg, shape, work, workers, choice, 989.0).step_flops  # per worker (the peak only sets times)
    rate, how = _this_machines_rate(cfg)
    hours = flops / rate / 3600
    if how.startswith("this CPU"):
        fix += ", or train on GPUs (model.device=cuda)"
    if hours > MAX_STEP_HOURS:
        raise ConfigError(field, value, f"a step samples {images} images ({r.num_steps} steps each) and trains on "
                          f"them: {flops * workers / 1e15:.1f} PFLOP of denoiser work, at least {hours:.0f} hours "
                          f"per step on each of trainer.n_workers={workers} at {how} ({rate / 1e12:.2f} TFLOP/s): "
                          f"{fix}")
