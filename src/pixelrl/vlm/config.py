"""Checks of a vision-language (`algorithm.trainer_type: vlm_ppo`) config, before any model loads."""

from __future__ import annotations

from pathlib import Path

from pixelrl.core.config import PixelRLConfig
from pixelrl.core.errors import ConfigError


def validate_vlm(cfg: PixelRLConfig) -> None:
    from pixelrl.vlm.token_losses import AGGREGATIONS, KL_ESTIMATORS
    from pixelrl.core.assets import resolve
    from pixelrl.config.validation import _check_backend, _choice, _positive, check_best_metric, check_lr_schedule
    from pixelrl.vlm.engine import SEQUENCE_ESTIMATORS, TOKEN_ESTIMATORS
    from pixelrl.vlm.qa_tasks import QA_TASKS

    v, r, a, t, d, m = cfg.vlm, cfg.rollout, cfg.actor, cfg.trainer, cfg.data, cfg.model
    _choice("model.type", m.type, ("qwen_vl",))
    path = Path(resolve(m.path))
    for name in ("config.json", "preprocessor_config.json"):
        if not (path / name).is_file():
            raise ConfigError("model.path", m.path, f"no {name} there: point it at a local Qwen2-VL folder "
                              "(config.json, *.safetensors, tokenizer files, preprocessor_config.json)")
    _choice("vlm.task", v.task, QA_TASKS.names())
    if v.task == "files" and not d.train_files:
        raise ConfigError("data.train_files", [], "vlm.task=files reads its questions from data.train_files: list "
                          ".jsonl or .parquet files with a question, `answer` and `image` per row")
    if v.task != "files" and (d.train_files or d.val_files or d.prompts):
        field = "data.train_files" if d.train_files else "data.val_files" if d.val_files else "data.prompts"
        raise ConfigError(field, list(getattr(d, field.split(".")[1])), f"vlm.task={v.task} draws its questions "
                          "from the built-in task: remove it, or set vlm.task=files to train on these files")
    if d.source_weights:
        raise ConfigError("data.source_weights", dict(d.source_weights), "weights the diffusion trainers' prompt "
                          "rows; a vision-language run reads its questions as they are: remove it")
    _choice("vlm.estimator", v.estimator, SEQUENCE_ESTIMATORS + TOKEN_ESTIMATORS)
    _choice("vlm.policy_loss", v.policy_loss, ("ppo", "gspo", "cpg"))
    _choice("vlm.aggregation", v.aggregation, AGGREGATIONS)
    _choice("vlm.kl_estimator", v.kl_estimator, KL_ESTIMATORS)
    if v.ptx_coef > 0 and not v.ptx_files:
        raise ConfigError("vlm.ptx_files", [], "vlm.ptx_coef > 0 trains a supervised loss on a pretraining / SFT set "
                          "of its own: list .jsonl or .parquet files of (image, question, answer) rows (the layout "
                          "of vlm.task=files), or set vlm.ptx_coef=0")
    if v.ptx_files and v.ptx_coef == 0:
        raise ConfigError("vlm.ptx_files", list(v.ptx_files), "nothing reads these files while vlm.ptx_coef=0: set "
                          "vlm.ptx_coef > 0 (LightRFT's ptx_coef) or remove them")
    _check_backend(t)
    check_best_metric(t)
    _choice("trainer.strategy", t.strategy, ("ddp", "fsdp2"))
    _positive("trainer.n_workers", t.n_workers)
    _positive("trainer.num_cpus_per_worker", t.num_cpus_per_worker)
    if cfg.model.compile:
        raise ConfigError("model.compile", True, "compiles a diffusion denoiser; the vision-language trainer "
                          "runs its policy eagerly: remove it")
    if cfg.val_kwargs.rewards:
        raise ConfigError("val_kwargs.rewards", list(cfg.val_kwargs.rewards), "gold rewards judge validation images; "
                          "the vision-language trainer validates by held-out answer accuracy: remove it")
    if cfg.reward.placement != "colocated" or cfg.reward.num_gpus:
        field = "reward.placement" if cfg.reward.placement != "colocated" else "reward.num_gpus"
        raise ConfigError(field, cfg.reward.placement if field == "reward.placement" else cfg.reward.num_gpus,
                          "the vision-language trainer scores answers on its actor workers (string rewards are "
                          "cheap): leave reward.placement=colocated and reward.num_gpus=0")
    if cfg.reward.on_error != "stop":
        raise ConfigError("reward.on_error", cfg.reward.on_error, "the vision-language trainer's rewards are string "
                          "checks on its actors, which stop the run when they fail: leave reward.on_error=stop")
    if t.mode != "sync" or r.n_workers:
        raise ConfigError("trainer.mode" if t.mode != "sync" else "rollout.n_workers",
                          t.mode if t.mode != "sync" else r.n_workers,
                          "the vision-language trainer samples on its actor workers, on-policy: use trainer.mode=sync "
                          "and rollout.n_workers=0")
    for field, value in (("data.train_batch_size", d.train_batch_size), ("vlm.val_items", v.val_items)):
        if value % t.n_workers:
            raise ConfigError(field, value, f"each of the trainer.n_workers={t.n_workers} workers takes an equal "
                              f"share of the questions: use a multiple of {t.n_workers}")
    for field, value in (("vlm.max_new_tokens", v.max_new_tokens), ("vlm.top_p", v.top_p),
                         ("vlm.advantage_clamp", v.advantage_clamp), ("vlm.critic_lr", v.critic_lr),
                         ("vlm.kl_horizon", v.kl_horizon), ("vlm.val_items", v.val_items),
                         ("rollout.n", r.n), ("data.train_batch_size", d.train_batch_size),
                         ("actor.lr", a.lr), ("actor.ppo_epochs", a.ppo_epochs),
                         ("actor.ppo_micro_batch_size", a.ppo_micro_batch_size), ("actor.adam_eps", a.adam_eps),
                         ("trainer.total_training_steps", t.total_training_steps)):
        _positive(field, value)
    for field, value in (("vlm.temperature", v.temperature), ("vlm.kl_coef", v.kl_coef),
                         ("vlm.clip_low", v.clip_low), ("vlm.clip_high", v.clip_high), ("vlm.gamma", v.gamma),
                         ("vlm.lam", v.lam), ("vlm.ptx_coef", v.ptx_coef), ("vlm.entropy_coef", v.entropy_coef),
                         ("vlm.ema_decay", v.ema_decay),
                         ("vlm.freezing_actor_steps", v.freezing_actor_steps),
                         ("vlm.min_pixels", v.min_pixels), ("vlm.max_pixels", v.max_pixels),
                         ("trainer.time_budget_s", t.time_budget_s)):
        _positive(field, value, allow_zero=True)
    if v.min_pixels and v.max_pixels and v.min_pixels > v.max_pixels:
        raise ConfigError("vlm.min_pixels", v.min_pixels, f"above vlm.max_pixels = {v.max_pixels}: the image size "
                          "bounds need min <= max")
    if v.top_p > 1:
        raise ConfigError("vlm.top_p", v.top_p, "must be in (0, 1]")
    if not 0 <= v.entropy_mask_ratio <= 1:
        raise ConfigError("vlm.entropy_mask_ratio", v.entropy_mask_ratio, "must be in [0, 1] (0 = every token)")
    if v.ema_decay >= 1:
        raise ConfigError("vlm.ema_decay", v.ema_decay, "must be in [0, 1) (0 = no EMA; LightRFT uses 0.992)")
    if cfg.actor.ema_decay:
        raise ConfigError("actor.ema_decay", cfg.actor.ema_decay, "is the diffusion trainers' EMA: a vision-language "
                          "run keeps its EMA actor with vlm.ema_decay (and vlm.validate_ema)")
    if v.validate_ema and v.ema_decay == 0:
        raise ConfigError("vlm.validate_ema", True, "there is no EMA actor to validate: set vlm.ema_decay > 0 "
                          "(e.g. 0.99) or remove vlm.validate_ema")
    if v.dual_clip is not None and v.dual_clip <= 1:
        raise ConfigError("vlm.dual_clip", v.dual_clip, "the dual-clip constant must be > 1 (verl uses 3), or null")
    if v.value_clip is not None:
        _positive("vlm.value_clip", v.value_clip)
    if v.kl_target is not None:
        _positive("vlm.kl_target", v.kl_target)
        if v.kl_coef == 0:
            raise ConfigError("vlm.kl_coef", 0, "the adaptive controller scales an initial coefficient: set "
                              "vlm.kl_coef > 0 (e.g. 0.01) with vlm.kl_target")
    if v.estimator in SEQUENCE_ESTIMATORS and r.n < 2:
        raise ConfigError("rollout.n", r.n, f"vlm.estimator={v.estimator} compares samples of one prompt: "
                          "use rollout.n >= 2")
    if v.estimator != "gae" and v.freezing_actor_steps:
        raise ConfigError("vlm.freezing_actor_steps", v.freezing_actor_steps,
                          "a critic warm-up needs the critic: set vlm.estimator=gae or freezing_actor_steps=0")
    if v.policy_loss == "gspo" and v.aggregation != "seq-mean-token-mean":
        raise ConfigError("vlm.aggregation", v.aggregation, "GSPO is defined with seq-mean-token-mean")
    samples = d.train_batch_size * r.n
    mini = a.ppo_mini_batch_size or samples
    if mini > samples or samples % mini or mini % t.n_workers:
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size,
                          f"must divide the {samples} responses of a step and be a multiple of trainer.n_workers "
                          f"({t.n_workers}); 0 = the whole batch")
    check_lr_schedule(cfg, frozen_steps=v.freezing_actor_steps)
