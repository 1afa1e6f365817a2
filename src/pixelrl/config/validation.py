"""Check a run configuration before anything is built: every field and every rule that spans
sections, each failure one `ConfigError` naming the field, the value and the fix. This package
sits above the components whose choices it checks (losses, samplers, models, rewards, the
learner); `pixelrl.core.config_io` below reads and writes the YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pixelrl.core.config import PixelRLConfig
from pixelrl.core.config_io import merge_config
from pixelrl.core.errors import ConfigError
from pixelrl.core.plugins import import_plugins
from pixelrl.core.registry import Registry

# the diffusion trainers' types, whose sections this module checks
DIFFUSION_TRAINERS = ("transition", "forward_process")


@dataclass(frozen=True)
class SeparateTrainer:
    """A trainer with its own loop and config checks, registered by its package (the VLM trainer):
    `check(cfg)` raises a ConfigError; `trainer_class()` imports and returns the trainer."""
    check: Callable[[PixelRLConfig], None]
    trainer_class: Callable[[], type]


SEPARATE_TRAINERS: Registry = Registry("trainer type", "algorithm.trainer_type")


def compose_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The named config with `overrides` and its plugins imported, not yet validated (`pixelrl
    plan` checks a recipe whose folders are on another machine itself)."""
    cfg = merge_config(config_name, overrides)
    cfg.plugins = import_plugins(cfg.plugins)
    return cfg


def load_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The named config with `overrides`, its plugins imported (they register names that the
    checks look up) and every field checked."""
    cfg = compose_config(config_name, overrides)
    validate(cfg)
    if cfg.trainer.fit_to_memory_gb:
        if cfg.algorithm.trainer_type not in DIFFUSION_TRAINERS:
            raise ConfigError("trainer.fit_to_memory_gb", cfg.trainer.fit_to_memory_gb, "the memory plan sizes the "
                              "diffusion trainers' denoiser calls; the vision-language trainer takes "
                              "actor.ppo_micro_batch_size as written: remove trainer.fit_to_memory_gb")
        cfg = _fitted_to_memory(cfg)
    return cfg


def _fitted_to_memory(cfg: PixelRLConfig) -> PixelRLConfig:
    """trainer.fit_to_memory_gb: the plan's micro-batches and checkpointing, announced once."""
    import sys

    from pixelrl.config.plan import apply_choice, plan_for

    # plan_for validates the config with its choices applied (check_recipe); this run's own files
    # passed validation above, so that check is complete here
    plan = plan_for(cfg, cfg.trainer.n_workers, cfg.trainer.fit_to_memory_gb, cfg.trainer.peak_tflops or 989.0,
                    field="trainer.fit_to_memory_gb")
    fitted = apply_choice(cfg, plan.choice)
    chosen = " ".join(o for o in plan.overrides if not o.startswith(("trainer.n_workers", "trainer.backend")))
    print(f"pixelrl: trainer.fit_to_memory_gb={cfg.trainer.fit_to_memory_gb:g}: {chosen or 'the config as written'} "
          f"(estimated peak {plan.estimate.peak_gb:.1f} GB per GPU, {plan.estimate.step_s:.1f} s per step before "
          "the rewards; `pixelrl plan` shows the estimate)", file=sys.stderr)
    return fitted


def _choice(field: str, value, options) -> None:
    if value not in options:
        raise ConfigError(field, value, f"choose one of {list(options)}")


def _check_backend(t) -> None:
    """The local backend runs one worker in this process: a larger trainer.n_workers would be
    ignored there while the batch checks (and the user) count on it."""
    _choice("trainer.backend", t.backend, ("ray", "local"))
    if t.backend == "local" and t.n_workers != 1:
        raise ConfigError("trainer.n_workers", t.n_workers, "trainer.backend=local runs one in-process worker: "
                          "set trainer.n_workers=1, or trainer.backend=ray for data parallelism")
    _positive("trainer.max_restarts", t.max_restarts, allow_zero=True)
    if t.backend == "local" and t.max_restarts:
        raise ConfigError("trainer.max_restarts", t.max_restarts, "restarts start Ray workers again after one "
                          "dies; the local backend's worker is this process: set trainer.backend=ray or 0")


def check_best_metric(t) -> None:
    """trainer.best_metric picks a checkpoint by a validation metric: it needs validations after
    training steps, and a validation key (training metrics are of one batch, not held out)."""
    if not t.best_metric:
        return
    if t.best_metric.split("/")[0] not in ("val-core", "val-aux", "val") or "/" not in t.best_metric:
        raise ConfigError("trainer.best_metric", t.best_metric, "name a validation metric, e.g. "
                          "val-aux/overall/shapes_strict/mean@4 (the mean over data sources), "
                          "val-core/<source>/reward/mean@<n>, or val/accuracy for the vision-language trainer")
    if t.test_freq == -1:
        raise ConfigError("trainer.best_metric", t.best_metric, "trainer.test_freq=-1 never validates: set "
                          "trainer.test_freq to how often (in steps) the best checkpoint is looked for")


def _positive(field: str, value, allow_zero: bool = False, allow_inf: bool = False) -> None:
    if value != value or (value == float("inf") and not allow_inf):  # NaN, inf
        raise ConfigError(field, value, "must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(field, value, "must be " + ("non-negative" if allow_zero else "positive"))


def _check_schedule_and_validation(cfg: PixelRLConfig) -> None:
    """Fields that used to pass and fail later: validation settings at the first validation (after
    training, before the final checkpoint), optimizer and resource numbers in a library call."""
    t, vk, a = cfg.trainer, cfg.val_kwargs, cfg.actor
    for field, value in (("trainer.save_freq", t.save_freq), ("trainer.test_freq", t.test_freq)):
        if value < -1:
            raise ConfigError(field, value, "steps between saves / validations: a positive number, 0 (only at the "
                              "last step) or -1 (never)")
    _positive("val_kwargs.n", vk.n)
    _positive("val_kwargs.num_steps", vk.num_steps)
    _positive("val_kwargs.noise_level", vk.noise_level, allow_zero=True)
    _positive("data.val_batch_size", cfg.data.val_batch_size, allow_zero=True)  # 0 = the whole set at once
    betas = list(a.betas)
    if len(betas) != 2 or any(not (isinstance(b, (int, float)) and 0 <= b < 1) for b in betas):
        raise ConfigError("actor.betas", betas, "Adam's two decay rates, each in [0, 1), e.g. [0.9, 0.999]")
    _positive("actor.weight_decay", a.weight_decay, allow_zero=True)
    _positive("actor.warmup_steps", a.warmup_steps, allow_zero=True)
    if not 0 <= a.min_lr_ratio <= 1:
        raise ConfigError("actor.min_lr_ratio", a.min_lr_ratio, "the cosine's floor as a fraction of actor.lr, in [0, 1]")
    _positive("reward.num_cpus", cfg.reward.num_cpus)
    _positive("model.max_sequence_length", cfg.model.max_sequence_length, allow_zero=True)
    if not cfg.data.train_files and cfg.data.prompts and any(not str(p).strip() for p in cfg.data.prompts):
        raise ConfigError("data.prompts", list(cfg.data.prompts), "an inline prompt is empty or blank: give each "
                          "prompt some text, or read prompts from data.train_files")


def _check_device(cfg: PixelRLConfig) -> None:
    """A device torch cannot name is refused; so is a CUDA device in a one-process run on a machine
    that has none (Ray workers may sit on other nodes with GPUs, so only the local backend knows)."""
    import torch

    device = cfg.model.device
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ConfigError("model.device", device, "not a torch device: use cpu, cuda or cuda:N") from None
    if kind == "cuda" and cfg.trainer.backend == "local" and not torch.cuda.is_available():
        raise ConfigError("model.device", device, "no CUDA device is visible here (torch.cuda.is_available() is "
                          "False): use model.device=cpu, or run on a machine with a GPU and a CUDA build of torch")


def _check_rollout_correction(a) -> None:
    from pixelrl.algos.rollout_correction import IS_LEVELS, RS_LEVELS, rejection_bounds

    _choice("algorithm.rollout_is", a.rollout_is, IS_LEVELS)
    _choice("algorithm.rollout_rs", a.rollout_rs, RS_LEVELS)
    _positive("algorithm.rollout_is_threshold", a.rollout_is_threshold)
    for field in ("rollout_rs_lower", "rollout_rs_upper"):
        if getattr(a, field) is not None:
            _positive(f"algorithm.{field}", getattr(a, field), allow_zero=field == "rollout_rs_lower")
    lo, hi = rejection_bounds(a.rollout_rs_lower, a.rollout_rs_upper)
    if lo > hi:
        raise ConfigError("algorithm.rollout_rs_lower", lo, f"is above algorithm.rollout_rs_upper ({hi}): every "
                          "sample-step would be rejected; set lower <= upper")


def _check_rollout_pool(cfg: PixelRLConfig) -> None:
    """Modes that sample ahead need a separate rollout pool, and only transition losses re-score
    (and so correct) a stale batch."""
    r, t = cfg.rollout, cfg.trainer
    _choice("trainer.mode", t.mode, ("sync", "one_step_off", "async"))
    _positive("trainer.max_staleness", t.max_staleness, allow_zero=True)
    _positive("rollout.n_workers", r.n_workers, allow_zero=True)
    _positive("rollout.num_cpus_per_worker", r.num_cpus_per_worker)
    if t.mode != "sync" and r.n_workers == 0:
        raise ConfigError("rollout.n_workers", 0, f"trainer.mode={t.mode} samples ahead on a separate rollout pool: "
                          "set rollout.n_workers=1 (or more)")
    if r.n_workers and (cfg.algorithm.trainer_type != "transition" or cfg.algorithm.sample_source != "online"):
        raise ConfigError("rollout.n_workers", r.n_workers, "a separate rollout pool serves the policy-gradient "
                          "trainer; direct-preference and offline runs sample on the actor workers (rollout.n_workers=0)")
    if r.n_workers and (cfg.data.train_batch_size * r.n) % r.n_workers:
        raise ConfigError("rollout.n_workers", r.n_workers, f"the {cfg.data.train_batch_size * r.n} images of a step "
                          "must split evenly over the rollout workers")


def validate(cfg: PixelRLConfig) -> None:
    """Cross-field checks: each error names the field to change and how."""
    from pixelrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from pixelrl.algos.forward_process import check_strata
    from pixelrl.algos.kl import KL_TYPES
    from pixelrl.algos.losses import LOSSES
    from pixelrl.models.base import DTYPES
    from pixelrl.core.assets import resolve
    from pixelrl.models.loader import MODEL_TYPES, check_model_type, declared_options, latent_unit, model_family
    from pixelrl.models.lora import LORA_INITS
    from pixelrl.sampling.multistep import SOLVERS
    from pixelrl.sampling.schedule import SIGMA_SCHEDULES
    from pixelrl.sampling.sde import SDE_TYPES
    from pixelrl.sampling.windows import WINDOW_SCHEDULES, check_window_args, window_params

    import pixelrl.rewards  # noqa: F401  (registers the built-in rewards)

    r, a, t, d, m = cfg.rollout, cfg.actor, cfg.trainer, cfg.data, cfg.model
    _choice("algorithm.trainer_type", cfg.algorithm.trainer_type, DIFFUSION_TRAINERS + tuple(SEPARATE_TRAINERS.names()))
    if cfg.algorithm.trainer_type in SEPARATE_TRAINERS:
        SEPARATE_TRAINERS.get(cfg.algorithm.trainer_type).check(cfg)
        _check_rewards_and_loggers(cfg)
        _check_output_locations(cfg)
        return
    _choice("model.type", m.type, MODEL_TYPES.names())
    _choice("model.dtype", m.dtype, sorted(DTYPES))
    _check_device(cfg)
    _choice("model.lora_init", m.lora_init, LORA_INITS)
    _positive("model.lora_rank", m.lora_rank, allow_zero=True)
    _positive("model.lora_alpha", m.lora_alpha)
    _choice("rollout.logprob_reduction", r.logprob_reduction, ("mean", "sum"))
    _choice("rollout.sigma_schedule", r.sigma_schedule, SIGMA_SCHEDULES)
    _choice("rollout.sde_type", r.sde_type, [s for s in SDE_TYPES if s != "ode"])
    _choice("diffusion_loss.name", cfg.diffusion_loss.name, LOSSES.names())
    bound = LOSSES.get(cfg.diffusion_loss.name).bind(cfg.diffusion_loss)  # the loss's own params, checked
    if hasattr(bound, "num_timesteps"):
        check_strata(bound.timesteps, bound.num_timesteps, r.num_steps, getattr(bound, "timestep_fraction", 1.0),
                     getattr(bound, "max_timestep_index", None))
    if getattr(bound, "group_noise", False) and r.n < 2:
        raise ConfigError("diffusion_loss.params.group_noise", True, f"shares noise within a prompt's group, and "
                          f"rollout.n={r.n} makes groups of one: set rollout.n >= 2 or group_noise=false")
    if LOSSES.get(cfg.diffusion_loss.name).whole_groups:
        _check_whole_groups(cfg)
    if cfg.diffusion_loss.name == "grpo_guard" and r.sde_type == "cps":
        raise ConfigError("rollout.sde_type", r.sde_type, "grpo_guard rescales by the step's std, and the cps "
                          "log-prob has no variance term: use rollout.sde_type=sde with grpo_guard")
    for field, value in (("diffusion_loss.clip_ratio", cfg.diffusion_loss.clip_ratio),
                         ("diffusion_loss.adv_clip_max", cfg.diffusion_loss.adv_clip_max),
                         ("algorithm.adv_eps", cfg.algorithm.adv_eps), ("actor.max_grad_norm", a.max_grad_norm)):
        _positive(field, value, allow_inf=field != "algorithm.adv_eps")  # an infinite clip = no clipping
    _positive("actor.adam_eps", a.adam_eps)
    if not 0 <= a.ema_decay < 1:
        raise ConfigError("actor.ema_decay", a.ema_decay, "must be in [0, 1): 0 keeps no EMA of the trained "
                          "weights; flow_grpo and DiffusionNFT keep one at 0.9")
    _positive("actor.ema_update_interval", a.ema_update_interval)
    _positive("rollout.guidance_scale", r.guidance_scale, allow_zero=True)
    if cfg.val_kwargs.guidance_scale is not None:
        _positive("val_kwargs.guidance_scale", cfg.val_kwargs.guidance_scale, allow_zero=True)
    _choice("diffusion_loss.kl_type", cfg.diffusion_loss.kl_type, KL_TYPES)
    _choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS.names())
    _choice("algorithm.rollout_correction", cfg.algorithm.rollout_correction, ("bypass", "decoupled"))
    _check_rollout_correction(cfg.algorithm)
    _check_schedule_and_validation(cfg)
    _choice("algorithm.reward_aggregation", cfg.algorithm.reward_aggregation, ("sum_rewards", "sum_advantages"))
    objective = LOSSES.get(cfg.diffusion_loss.name).objective
    _positive("actor.window_steps_per_forward", cfg.actor.window_steps_per_forward, allow_zero=True)
    if cfg.actor.window_steps_per_forward != 1 and not LOSSES.get(cfg.diffusion_loss.name).steps_batchable:
        batchable = [n for n in LOSSES.names() if LOSSES.get(n).steps_batchable]
        raise ConfigError("actor.window_steps_per_forward", cfg.actor.window_steps_per_forward,
                          f"loss `{cfg.diffusion_loss.name}` takes statistics across the batch of one window step "
                          f"(or draws its own timesteps), so steps cannot share a forward: use 1 (batchable: {batchable})")
    wanted = cfg.algorithm.trainer_type  # the family is the loss's objective
    if objective != wanted:
        fitting = [n for n in LOSSES.names() if LOSSES.get(n).objective == wanted]
        raise ConfigError("diffusion_loss.name", cfg.diffusion_loss.name,
                          f"algorithm.trainer_type={cfg.algorithm.trainer_type} trains {wanted} losses: {fitting}")
    loss = LOSSES.get(cfg.diffusion_loss.name)
    # AWM with ema_beta 0 reads no old policy, so it can fine-tune the whole denoiser
    if "v_old" in loss.step_keys_needed(loss.bind(cfg.diffusion_loss)) and m.lora_rank == 0:
        raise ConfigError("model.lora_rank", 0, f"{cfg.diffusion_loss.name} keeps the old policy as a second LoRA "
                          "adapter: use LoRA (model.lora_rank > 0)")
    if cfg.algorithm.trainer_type == "forward_process" and cfg.diffusion_loss.kl_coef > 0:
        raise ConfigError("diffusion_loss.kl_coef", cfg.diffusion_loss.kl_coef, "the KL coefficient belongs to "
                          "transition losses; forward-process losses set their reference term in diffusion_loss.params")
    if cfg.diffusion_loss.name == "diffusion_dpo":
        from pixelrl.core.config import mini_batches_per_epoch

        if cfg.data.train_batch_size % (cfg.trainer.n_workers * mini_batches_per_epoch(cfg)):
            raise ConfigError("data.train_batch_size", cfg.data.train_batch_size,
                              "online DPO trains one pair per prompt: the prompts per step must split into "
                              "trainer.n_workers x mini-batches")
    _choice("algorithm.sample_source", cfg.algorithm.sample_source, ("online", "offline"))
    if cfg.algorithm.sample_source == "offline" and d.source_weights:
        raise ConfigError("data.source_weights", dict(d.source_weights), "weights prompt rows by their data_source; "
                          "offline preference pairs are read as they are: remove it")
    if cfg.algorithm.sample_source == "offline":
        if cfg.algorithm.trainer_type != "forward_process" or cfg.diffusion_loss.name != "diffusion_dpo":
            raise ConfigError("algorithm.sample_source", "offline", "offline preference data trains Diffusion-DPO: "
                              "set algorithm.trainer_type=forward_process and diffusion_loss.name=diffusion_dpo")
        if not d.train_files:
            raise ConfigError("data.train_files", list(d.train_files), "offline DPO reads (prompt, chosen, rejected) "
                              "rows from a .jsonl or .parquet file: write one with `pixelrl make-preferences`")
    if getattr(bound, "rollout_policy", "current") == "old" and m.lora_rank == 0:
        raise ConfigError("diffusion_loss.params.rollout_policy", "old", "the old policy is a second LoRA adapter, "
                          "which full fine-tuning (model.lora_rank=0) does not keep: sample with "
                          "rollout_policy=current or train a LoRA")
    _choice("trainer.strategy", t.strategy, ("ddp", "fsdp2"))
    _check_backend(t)
    check_best_metric(t)
    _choice("reward.placement", cfg.reward.placement, ("colocated", "pool"))
    _choice("reward.on_error", cfg.reward.on_error, ("stop", "skip"))
    _positive("reward.max_consecutive_errors", cfg.reward.max_consecutive_errors)
    _check_reward_gpus(cfg)
    _check_rollout_pool(cfg)
    for field, value in (("rollout.n", r.n), ("rollout.num_steps", r.num_steps), ("rollout.resolution", r.resolution),
                         ("data.train_batch_size", d.train_batch_size), ("actor.ppo_epochs", a.ppo_epochs),
                         ("actor.ppo_micro_batch_size", a.ppo_micro_batch_size), ("trainer.n_workers", t.n_workers),
                         ("trainer.num_cpus_per_worker", t.num_cpus_per_worker), ("actor.lr", a.lr), ("rollout.micro_batch_size", r.micro_batch_size),
                         ("reward.num_workers", cfg.reward.num_workers)):
        _positive(field, value)
    _positive("rollout.noise_level", r.noise_level, allow_zero=True)
    _positive("diffusion_loss.kl_coef", cfg.diffusion_loss.kl_coef, allow_zero=True)
    _positive("trainer.time_budget_s", t.time_budget_s, allow_zero=True)
    _positive("trainer.peak_tflops", t.peak_tflops, allow_zero=True)
    _positive("trainer.fit_to_memory_gb", t.fit_to_memory_gb, allow_zero=True)
    _positive("trainer.profile_step", t.profile_step, allow_zero=True)
    _positive("trainer.total_training_steps", t.total_training_steps, allow_zero=True)  # 0 = from the epochs
    _positive("trainer.total_epochs", t.total_epochs)
    _choice("rollout.solver", r.solver, SOLVERS)
    if r.solver != "euler" and r.noise_level > 0:
        raise ConfigError("rollout.solver", r.solver, "a multistep solver samples deterministically: set "
                          "rollout.noise_level=0 or rollout.solver=euler")
    _choice("rollout.sde_window_schedule", r.sde_window_schedule, WINDOW_SCHEDULES)
    window_params(r.sde_window_schedule, r.sde_window_params)
    if r.sde_window_size and r.sde_window_schedule == "random":
        check_window_args(r.num_steps, r.sde_window_size, r.sde_window_range)
    elif r.sde_window_size and r.sde_window_size > r.num_steps - 2:
        raise ConfigError("rollout.sde_window_size", r.sde_window_size,
                          f"a MixGRPO window needs sde_window_size <= num_steps - 2 = {r.num_steps - 2}")
    if not 0 < a.timestep_fraction <= 1:
        raise ConfigError("actor.timestep_fraction", a.timestep_fraction, "must be in (0, 1]")
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if getattr(estimator, "needs_groups", False) and r.n < 2:
        raise ConfigError("rollout.n", r.n, f"`{cfg.algorithm.adv_estimator}` normalises within groups of images of "
                          "one prompt: use rollout.n >= 2 (the paper uses 24 for SD3.5)")
    samples = d.train_batch_size * r.n
    if samples % t.n_workers:
        raise ConfigError("data.train_batch_size", d.train_batch_size,
                          f"train_batch_size x rollout.n = {samples} images must divide evenly across "
                          f"trainer.n_workers = {t.n_workers}")
    mini = a.ppo_mini_batch_size or samples
    if mini > samples or samples % mini or mini % t.n_workers:
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size,
                          f"must divide the {samples} images of a step and be a multiple of trainer.n_workers "
                          f"({t.n_workers}); 0 means the whole batch")
    check_lr_schedule(cfg)
    if m.compile and t.strategy == "fsdp2":
        raise ConfigError("model.compile", True, "compiling the denoiser is supported on one process and with "
                          "DDP, not with FSDP2's sharded blocks (untested there): use trainer.strategy=ddp or "
                          "remove model.compile")
    if t.strategy == "fsdp2" and (mini // t.n_workers) % min(a.ppo_micro_batch_size, mini // t.n_workers):
        raise ConfigError("actor.ppo_micro_batch_size", a.ppo_micro_batch_size,
                          "with fsdp2 every worker must run the same number of forwards: make the per-worker "
                          f"mini-batch ({mini // t.n_workers}) a multiple of the micro-batch")
    if not cfg.model.path:
        raise ConfigError("model.path", cfg.model.path, "set it to a local diffusers pipeline folder")
    folder = Path(resolve(str(m.path)))
    model_family(m.type).check_options(m.max_sequence_length, m.num_frames, folder if folder.is_dir() else None)
    unit = latent_unit(m.type, m.path)
    if unit and r.resolution % unit:
        raise ConfigError("rollout.resolution", r.resolution,
                          f"this model needs a multiple of {unit} (VAE scale x patch size), e.g. {r.resolution // unit * unit or unit}")
    if not d.train_files and not d.prompts:
        raise ConfigError("data.train_files", d.train_files, "give a jsonl / parquet / txt prompt file (or data.prompts)")
    _check_rewards_and_loggers(cfg)
    _check_output_locations(cfg)
    # last: a config copied from another machine reports its field errors before its model path
    if not Path(resolve(str(m.path))).is_dir():
        raise ConfigError("model.path", m.path, "the folder does not exist: set model.path to a local diffusers "
                          "pipeline folder (or builtin:shapes; `pixelrl build-tiny DIR` makes a tiny random one)")
    check_model_type(m.type, m.path)
    for option, value in declared_options(m.path).items():
        if getattr(m, option) != value:
            raise ConfigError(f"model.{option}", getattr(m, option), f"the model folder was trained with {value} "
                              f"(its pixelrl_model.json): set model.{option}={value}")
    from pixelrl.config.step_size import check_step_size

    check_step_size(cfg)  # needs the model's shape: last


def _check_output_locations(cfg: PixelRLConfig) -> None:
    """Every folder the run writes into can be made and written, checked before any worker starts
    (a bad one would otherwise surface at the first checkpoint, after the work it was to keep)."""
    from pixelrl.core.paths import check_output_dir

    t = cfg.trainer
    check_output_dir(t.default_local_dir, "trainer.default_local_dir")
    for field_name, value in (("trainer.rollout_data_dir", t.rollout_data_dir),
                              ("trainer.validation_data_dir", t.validation_data_dir)):
        if value:
            check_output_dir(value, field_name)


def check_lr_schedule(cfg: PixelRLConfig, frozen_steps: int = 0) -> None:
    """`actor.lr_schedule` and `actor.min_lr_ratio`; a cosine decays over the actor's optimizer
    steps of the whole run (after `frozen_steps` training steps without an actor update), which
    must outlast the warm-up."""
    from pixelrl.core.config import actor_optimizer_steps, optimizer_steps_per_rollout
    from pixelrl.engine.learner import LR_SCHEDULES

    a, t = cfg.actor, cfg.trainer
    _choice("actor.lr_schedule", a.lr_schedule, LR_SCHEDULES)
    if not 0 <= a.min_lr_ratio <= 1:
        raise ConfigError("actor.min_lr_ratio", a.min_lr_ratio, "must be in [0, 1] (the final lr over actor.lr)")
    actor_steps = actor_optimizer_steps(cfg, frozen_steps)
    if a.lr_schedule == "cosine" and actor_steps <= a.warmup_steps:
        raise ConfigError("trainer.total_training_steps", t.total_training_steps,
                          f"a cosine lr decays over the actor's optimizer steps ({actor_steps} in this run: "
                          f"{optimizer_steps_per_rollout(cfg)} per training step"
                          + (f", none in the {frozen_steps} of vlm.freezing_actor_steps" if frozen_steps else "")
                          + f"), which must outnumber actor.warmup_steps ({a.warmup_steps}): train longer")


def _check_whole_groups(cfg: PixelRLConfig) -> None:
    """A loss that sums over each prompt group (DGPO) sees whole groups in every micro-batch: each
    worker's share, each mini-batch and each micro-batch hold whole groups of rollout.n images,
    and no sample is dropped from its group."""
    r, a, t, name = cfg.rollout, cfg.actor, cfg.trainer, cfg.diffusion_loss.name
    if r.n < 2:
        raise ConfigError("rollout.n", r.n, f"{name} compares the images of a prompt's group: use rollout.n >= 2")
    if cfg.algorithm.drop_zero_advantage:
        raise ConfigError("algorithm.drop_zero_advantage", True, f"{name} needs every image of a group (its "
                          "group sums); set algorithm.drop_zero_advantage=false, as the reference keeps them")
    if cfg.data.train_batch_size % t.n_workers:
        raise ConfigError("data.train_batch_size", cfg.data.train_batch_size, f"{name} keeps prompt groups whole on "
                          f"each worker: use a multiple of trainer.n_workers={t.n_workers}")
    images = cfg.data.train_batch_size * r.n
    per_worker_mini = (a.ppo_mini_batch_size or images) // t.n_workers
    if per_worker_mini % r.n or per_worker_mini * t.n_workers != (a.ppo_mini_batch_size or images):
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, f"{name} needs whole prompt groups in "
                          f"each optimizer step on each worker: a multiple of rollout.n x trainer.n_workers = "
                          f"{r.n * t.n_workers}")
    if a.ppo_micro_batch_size % r.n:
        raise ConfigError("actor.ppo_micro_batch_size", a.ppo_micro_batch_size, f"{name} sums over whole prompt "
                          f"groups in each forward: use a multiple of rollout.n={r.n}")


def _check_rewards_and_loggers(cfg: PixelRLConfig) -> None:
    from pixelrl.rewards.registry import REWARDS, check_reward_options

    t = cfg.trainer
    if not cfg.reward.functions:
        raise ConfigError("reward.functions", cfg.reward.functions, "list at least one reward")
    _positive("reward.timeout_s", cfg.reward.timeout_s, allow_zero=True)  # 0 = no deadline
    for field_name, specs in (("reward.functions", cfg.reward.functions), ("val_kwargs.rewards", cfg.val_kwargs.rewards)):
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
    if all(spec.get("weight", 1.0) == 0 for spec in cfg.reward.functions):
        raise ConfigError("reward.functions[].weight", [spec.get("weight", 1.0) for spec in cfg.reward.functions],
                          "every training reward is weighted 0, so every advantage is 0 and nothing trains: give "
                          "at least one reward a non-zero weight")
    for logger in t.logger:
        _choice("trainer.logger", logger, ("console", "jsonl", "tensorboard", "wandb"))
    if t.resume_mode not in ("auto", "disable") and not Path(t.resume_mode).is_dir():
        raise ConfigError("trainer.resume_mode", t.resume_mode,
                          "use auto, disable, or the path of an existing global_step_N checkpoint folder")


def _check_reward_gpus(cfg) -> None:
    """Reward workers with their own GPUs need Ray, the pool placement, and GPUs to be had;
    otherwise Ray would wait forever for a GPU no node offers."""
    import os

    gpus = cfg.reward.num_gpus
    _positive("reward.num_gpus", gpus, allow_zero=True)
    if gpus == 0:
        return
    if cfg.reward.placement != "pool" or cfg.trainer.backend != "ray":
        raise ConfigError("reward.num_gpus", gpus, "GPUs of its own are for reward workers in their own pool: set "
                          "reward.placement=pool and trainer.backend=ray (or reward.num_gpus=0)")
    import torch

    if not (cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")) and torch.cuda.device_count() == 0:
        raise ConfigError("reward.num_gpus", gpus, "this machine has no GPU and no Ray cluster is named: join one "
                          "(trainer.ray_address) or set reward.num_gpus=0")
