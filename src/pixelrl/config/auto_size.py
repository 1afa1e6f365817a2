"""`auto` sizes: the micro-batches and checkpointing chosen at start-up to fit the memory each
worker has, by the same plan as `pixelrl plan` (pixelrl.config.plan), before any worker starts.

The memory is `trainer.fit_to_memory_gb` when set, else the GPU's (`model.device` cuda: what the
card has free in one process, `trainer.backend: local`; its total memory on Ray, where the
driver holds no GPU), else this machine's RAM shared by the workers;
in one process, less the weights of reward models that score on the same card.
A field written as a number stays as written; `trainer.fit_to_memory_gb` with no `auto` field
chooses all three (a recipe written for other cards, fitted to these).
"""

from __future__ import annotations

import sys

from pixelrl.config.plan import Choice, apply_choice, estimate, model_shape, plan_for, step_work, written_sizes
from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.errors import AUTO, ConfigError


def auto_fields(cfg: PixelRLConfig) -> tuple[str, ...]:
    """The size fields written as `auto`."""
    return tuple(name for name, value in written_sizes(cfg).items() if value == AUTO)


def worker_memory_gb(cfg: PixelRLConfig, field: str) -> tuple[float, str]:
    """Each worker's memory in GB and where that number came from."""
    import psutil
    import torch

    device = torch.device(cfg.model.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(field, AUTO, "sizes against each GPU's memory, and this process sees no CUDA device "
                              "(Ray workers on other nodes): set trainer.fit_to_memory_gb to each GPU's memory in GB, "
                              "e.g. 80")
        index = device.index or 0
        props = torch.cuda.get_device_properties(index)
        if cfg.trainer.backend == "local":
            # this process is the worker: what the card has free now (another job's share, a reward
            # server's, taken off), read through the CUDA context it is about to create anyway. A Ray
            # driver reads the total instead: a context there would sit on a worker's GPU all run
            free, total = torch.cuda.mem_get_info(index)
            return free / 1e9, f"{props.name}'s free memory, {free / 1e9:.1f} of {total / 1e9:.1f} GB"
        return props.total_memory / 1e9, f"{props.name}'s memory"
    workers = cfg.trainer.n_workers
    return psutil.virtual_memory().total / 1e9 / workers, f"this machine's RAM over {workers} worker(s)"


def reward_models_gb(cfg: PixelRLConfig) -> float:
    """GB of reward-model weights that load onto the policy's GPU: in one process
    (`trainer.backend: local`) a model-based reward scores on the same card, so its weights
    (the safetensors files under its `path`) come out of the memory the sizes may use. The
    scoring's own activations are not counted. Ray's reward workers reserve no GPU share of the
    policy's (colocated) or have GPUs of their own (a pool): nothing to take off there."""
    from pathlib import Path

    import torch

    if cfg.trainer.backend != "local" or torch.device(cfg.model.device).type != "cuda":
        return 0.0
    total = 0
    for function in cfg.reward.functions:
        path = (function.get("options") or {}).get("path")
        folder = Path(str(path)).expanduser() if path else None
        if folder is not None and folder.is_dir():
            total += sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    return total / 1e9


def fit_to_memory(cfg: PixelRLConfig) -> PixelRLConfig:
    """`cfg` with its `auto` sizes chosen (all sizes with trainer.fit_to_memory_gb and none
    `auto`), announced once on stderr. `cfg` has passed validation."""
    auto = auto_fields(cfg)
    if cfg.trainer.fit_to_memory_gb:
        field = source = "trainer.fit_to_memory_gb"
        memory = cfg.trainer.fit_to_memory_gb
    else:
        field = auto[0]
        memory, source = worker_memory_gb(cfg, field)
    rewards = reward_models_gb(cfg)
    if rewards:
        memory -= rewards
        source += f", less {rewards:.1f} GB of reward models on the same card"
    # plan_for validates the config with its choices applied (check_recipe); this run's own files
    # passed validation before, so its notes are empty here
    plan = plan_for(cfg, cfg.trainer.n_workers, memory, cfg.trainer.peak_tflops or 989.0, field=field,
                    free=auto or None)
    chosen = " ".join(o for o in plan.overrides if not o.startswith(("trainer.n_workers", "trainer.backend")))
    print(f"pixelrl: sized for {memory:.1f} GB per worker ({source}): {chosen or 'the config as written'} "
          f"(estimated peak {plan.estimate.peak_gb:.1f} GB, {plan.estimate.step_s:.1f} s per step before the "
          "rewards; `pixelrl plan` shows the estimate)", file=sys.stderr)
    return apply_choice(cfg, plan.choice)


def estimated_peak_gb(cfg: PixelRLConfig) -> float | None:
    """The plan's estimate of each worker's peak device memory with the sizes this run uses; the
    trainer logs it beside the measured `perf/peak_memory_gb` on a GPU, so the first step checks
    the estimate the `auto` sizes were chosen by. None where the model's shape is not known."""
    workers = cfg.trainer.n_workers
    try:
        shape = model_shape(cfg)
    except ConfigError:
        return None
    choice = Choice(cfg.actor.ppo_micro_batch_size, cfg.model.gradient_checkpointing, cfg.rollout.micro_batch_size,
                    cfg.trainer.strategy)
    return estimate(cfg, shape, step_work(cfg, workers), workers, choice, cfg.trainer.peak_tflops or 989.0).peak_gb
