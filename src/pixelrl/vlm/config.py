"""The vision-language trainer's config (`algorithm.trainer_type: vlm_ppo`): its `vlm:` section,
the schema that adds it to the shared sections, and the checks, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pixelrl.algos.config import TrainerTypeConfig
from pixelrl.config.sections import RunConfig
from pixelrl.core.errors import ConfigError, check_choice, check_number
from pixelrl.data.config import DataFilesConfig
from pixelrl.engine.config import UpdateConfig
from pixelrl.models.config import ModelFolderConfig
from pixelrl.rewards.config import RewardFunctionsConfig
from pixelrl.sampling.config import GroupSamplingConfig


@dataclass
class VLMConfig:
    """PPO / GRPO for a vision-language policy (token sequences). Samples per prompt are
    rollout.n; prompts per step data.train_batch_size; the optimizer is actor.*."""

    # the (image, question, answer) source: shapes_qa (built in) or files (data.train_files / val_files)
    task: str = "shapes_qa"
    # image size bounds in pixels for the model's image processor (0 = the folder's
    # preprocessor_config.json): an image is resized to keep its aspect within them, so max_pixels
    # caps the image tokens per prompt (max_pixels / (patch x merge)^2)
    min_pixels: int = 0
    max_pixels: int = 0
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # group_norm (GRPO) | rloo | reinforce_baseline (sequence baselines, no critic) | reinforce | gae (critic)
    estimator: str = "group_norm"
    gamma: float = 1.0
    lam: float = 0.95
    advantage_clamp: float = 10.0  # |A| cap after whitening (the VL trainer's clamp)
    policy_loss: str = "ppo"  # ppo | gspo | cpg
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1 caps -A rho at -A c for A < 0
    aggregation: str = "seq-mean-token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    kl_coef: float = 0.0  # beta (initial value with kl_target)
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl
    kl_in_reward: bool = False  # per-token -beta * kl in the reward (else a loss term)
    kl_target: float | None = None  # set: adaptive KL controller
    kl_horizon: int = 10000
    entropy_mask_ratio: float = 0.0  # train the policy on the top fraction of highest-entropy tokens
    # > 0: subtract coef x the policy's token entropy (aggregated like the policy loss) from the
    # actor loss, to keep sampling diverse (verl's actor.entropy_coeff)
    entropy_coef: float = 0.0
    # PPO's old log-probs (and the logged entropy) by a separate no-grad forward of the sampled
    # sequences, as verl and LightRFT do (their samplers are other engines). false: reuse those the
    # sampler computed with the same weights (equal within float reordering, one forward less)
    recompute_old_logp: bool = True
    # > 0: a supervised loss on rows of its own pretraining / SFT set, ptx_files, as LightRFT's
    # ptx_coef: plain text (.txt lines, or .jsonl / .parquet rows with `text`; every token is a
    # target, its pretrain mode) or (image, question, answer) rows as vlm.task=files (the answer is)
    ptx_coef: float = 0.0
    ptx_files: list = field(default_factory=list)
    ema_decay: float = 0.0  # > 0: keep an EMA of the actor (0.992 in LightRFT), saved with checkpoints
    validate_ema: bool = False  # validation scores the EMA actor (the model LightRFT keeps) instead of the actor
    critic_lr: float = 9e-6  # LightRFT's critic_learning_rate; the critic follows actor.*'s schedule
    # the vision tower keeps its weights, as LightRFT's GRPO scripts freeze it (--freeze_prefix);
    # false trains it too (full fine-tuning; a LoRA adapter sits on the language model only)
    freeze_vision_tower: bool = True
    value_clip: float | None = 0.2
    freezing_actor_steps: int = 0  # critic warm-up: only the critic trains for this many steps
    val_items: int = 300  # held-out items scored (greedy) at validation
    # DAPO's soft overlong punishment (docs/algorithms/vlm_ppo.md): > 0 = the last this-many
    # tokens before vlm.max_new_tokens cost up to overlong_penalty of reward, linearly (DAPO: 4096
    # of 20480, factor 1.0); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # DAPO's dynamic sampling: a group whose rewards are all equal is dropped and the step's
    # share refilled by sampling further questions, at most this many rounds in all (DAPO's
    # max_num_gen_batches, 10 in its recipe); what is still missing then is filled with dropped
    # groups (zero advantage, as LightRFT masks them). 0 = off
    dynamic_sampling_rounds: int = 0
    # LightRFT's reward processing, on the reward entering the advantage (after a sequence
    # baseline): divide by the running std of all such rewards so far (and subtract their mean),
    # then clip to [-reward_clip, reward_clip] (0 = no clip)
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    reward_clip: float = 0.0

    def check(self) -> None:
        """The section's own fields (the rules involving other sections are in `validate_vlm`)."""
        from pixelrl.vlm.engine import SEQUENCE_ESTIMATORS, TOKEN_ESTIMATORS
        from pixelrl.vlm.qa_tasks import QA_TASKS
        from pixelrl.vlm.token_losses import AGGREGATIONS, KL_ESTIMATORS

        check_choice("vlm.task", self.task, QA_TASKS.names())
        check_choice("vlm.estimator", self.estimator, SEQUENCE_ESTIMATORS + TOKEN_ESTIMATORS)
        check_choice("vlm.policy_loss", self.policy_loss, ("ppo", "gspo", "cpg"))
        check_choice("vlm.aggregation", self.aggregation, AGGREGATIONS)
        check_choice("vlm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.ptx_coef > 0 and not self.ptx_files:
            raise ConfigError("vlm.ptx_files", [], "vlm.ptx_coef > 0 trains a supervised loss on a pretraining / SFT "
                              "set of its own: list plain-text files (.txt lines, or .jsonl / .parquet rows with `text`) or "
                              "files of (image, question, answer) rows (the layout of vlm.task=files), or set "
                              "vlm.ptx_coef=0")
        if self.ptx_files and self.ptx_coef == 0:
            raise ConfigError("vlm.ptx_files", list(self.ptx_files), "nothing reads these files while vlm.ptx_coef=0: "
                              "set vlm.ptx_coef > 0 (LightRFT's ptx_coef) or remove them")
        for name in ("max_new_tokens", "top_p", "advantage_clamp", "critic_lr", "kl_horizon", "val_items"):
            check_number(f"vlm.{name}", getattr(self, name))
        for name in ("temperature", "kl_coef", "clip_low", "clip_high", "gamma", "lam", "ptx_coef", "entropy_coef",
                     "ema_decay", "freezing_actor_steps", "min_pixels", "max_pixels", "overlong_buffer",
                     "overlong_penalty", "dynamic_sampling_rounds", "reward_clip"):
            check_number(f"vlm.{name}", getattr(self, name), allow_zero=True)
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ConfigError("vlm.min_pixels", self.min_pixels, f"above vlm.max_pixels = {self.max_pixels}: the "
                              "image size bounds need min <= max")
        if self.top_p > 1:
            raise ConfigError("vlm.top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.entropy_mask_ratio <= 1:
            raise ConfigError("vlm.entropy_mask_ratio", self.entropy_mask_ratio, "must be in [0, 1] (0 = every token)")
        if self.ema_decay >= 1:
            raise ConfigError("vlm.ema_decay", self.ema_decay, "must be in [0, 1) (0 = no EMA; LightRFT uses 0.992)")
        if self.validate_ema and self.ema_decay == 0:
            raise ConfigError("vlm.validate_ema", True, "there is no EMA actor to validate: set vlm.ema_decay > 0 "
                              "(e.g. 0.99) or remove vlm.validate_ema")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError("vlm.dual_clip", self.dual_clip, "the dual-clip constant must be > 1 (verl uses 3), "
                              "or null")
        if self.value_clip is not None:
            check_number("vlm.value_clip", self.value_clip)
        if self.kl_target is not None:
            check_number("vlm.kl_target", self.kl_target)
            if self.kl_coef == 0:
                raise ConfigError("vlm.kl_coef", 0, "the adaptive controller scales an initial coefficient: set "
                                  "vlm.kl_coef > 0 (e.g. 0.01) with vlm.kl_target")
        if self.estimator != "gae" and self.freezing_actor_steps:
            raise ConfigError("vlm.freezing_actor_steps", self.freezing_actor_steps,
                              "a critic warm-up needs the critic: set vlm.estimator=gae or freezing_actor_steps=0")
        if self.overlong_buffer >= self.max_new_tokens:
            raise ConfigError("vlm.overlong_buffer", self.overlong_buffer, f"the penalty ramps over the last "
                              f"overlong_buffer tokens before vlm.max_new_tokens={self.max_new_tokens}: use fewer "
                              "(DAPO: 4096 of 20480), or 0 for none")
        if self.reward_running_norm_minus_mean and not self.reward_running_norm:
            raise ConfigError("vlm.reward_running_norm_minus_mean", True, "it changes the running normalisation: "
                              "set vlm.reward_running_norm=true too, or remove it")
        if self.dynamic_sampling_rounds and self.estimator not in ("group_norm", "rloo", "reinforce_baseline"):
            raise ConfigError("vlm.dynamic_sampling_rounds", self.dynamic_sampling_rounds, f"it drops groups whose "
                              f"samples all score alike, which only a group baseline makes useless; "
                              f"vlm.estimator={self.estimator} has none: use group_norm, rloo or reinforce_baseline")
        if self.policy_loss == "gspo" and self.aggregation != "seq-mean-token-mean":
            raise ConfigError("vlm.aggregation", self.aggregation, "GSPO is defined with seq-mean-token-mean")


@dataclass
class VLMModelConfig(ModelFolderConfig):
    """`model:` of a vision-language run: a local Qwen2-VL folder. LightRFT's defaults: full
    fine-tuning; a LoRA adapter (lora_rank > 0) on every linear layer of the language model with
    alpha 16."""

    type: str = "qwen_vl"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: list[str] | None = None  # None = every linear layer of the language model


@dataclass
class VLMActorConfig(UpdateConfig):
    """`actor:` of a vision-language run, with LightRFT's optimizer defaults: Adam betas (0.9,
    0.95), a cosine to 0.1 lr after a warm-up of 3% of the run (its cosine_with_min_lr)."""

    betas: tuple[float, float] = (0.9, 0.95)
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03


@dataclass
class VLMRunConfig:
    """A vision-language run's config: only the sections and fields its trainer reads (a
    diffusion trainer's field here is refused by name when the config loads)."""

    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    rollout: GroupSamplingConfig = field(default_factory=GroupSamplingConfig)
    actor: VLMActorConfig = field(default_factory=VLMActorConfig)
    algorithm: TrainerTypeConfig = field(default_factory=lambda: TrainerTypeConfig(trainer_type="vlm_ppo"))
    reward: RewardFunctionsConfig = field(default_factory=RewardFunctionsConfig)
    data: DataFilesConfig = field(default_factory=DataFilesConfig)
    trainer: RunConfig = field(default_factory=RunConfig)
    vlm: VLMConfig = field(default_factory=VLMConfig)
    seed: int = 0  # seeds LoRA init, the critic head, mini-batch shuffling and ptx rows
    plugins: list = field(default_factory=list)  # modules or .py files imported first (your own rewards)


# what a vision-language run uses where a diffusion config has these fields
DIFFUSION_FIELD_HINTS = {
    "actor.ema_decay": "a vision-language run keeps its EMA actor with vlm.ema_decay (and vlm.validate_ema)",
    "val_kwargs.rewards": "the vision-language trainer validates by held-out answer accuracy (vlm.val_items): "
                          "remove it",
    "trainer.fit_to_memory_gb": "the vision-language trainer takes actor.ppo_micro_batch_size as written: remove it",
    "reward.placement": "the vision-language trainer scores answers on its actor workers: remove it",
    "trainer.mode": "the vision-language trainer samples on its actor workers, on-policy (sync): remove it",
    "trainer.sequence_parallel_size": "the vision-language trainer holds whole sequences on each worker: remove it",
    "diffusion_loss.kl_coef": "a vision-language run's KL is vlm.kl_coef (vlm.kl_estimator, vlm.kl_target)",
}

# What a vision-language run did before its schema held only what it reads (2026-11-28), where
# today's defaults (LightRFT's) differ: a checkpoint saved then resumes and exports as it trained.
SAVED_BEFORE_OWN_SCHEMA = {"actor.warmup_ratio": 0.0, "vlm.freeze_vision_tower": False}


def upgrade_saved_config(layer) -> None:
    """A saved config written while a vision-language config carried every diffusion field (it
    has `diffusion_loss:`): the settings it trained with where a default has changed since."""
    from omegaconf import OmegaConf

    if "diffusion_loss" not in layer:
        return
    for key, value in SAVED_BEFORE_OWN_SCHEMA.items():
        if OmegaConf.select(layer, key) is None:
            OmegaConf.update(layer, key, value, merge=True)
    if OmegaConf.select(layer, "model.lora_rank", default=0) and OmegaConf.select(layer, "model.lora_target_modules") is None:
        OmegaConf.update(layer, "model.lora_target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"], merge=True)


def validate_vlm(cfg: VLMRunConfig) -> None:
    """The sections a vision-language run reads, and the rules between them."""
    from pixelrl.config.validation import check_lr_schedule
    from pixelrl.core.assets import resolve
    from pixelrl.vlm.engine import SEQUENCE_ESTIMATORS

    v, r, a, t, d, m = cfg.vlm, cfg.rollout, cfg.actor, cfg.trainer, cfg.data, cfg.model
    check_choice("model.type", m.type, ("qwen_vl",))
    path = Path(resolve(m.path))
    for name in ("config.json", "preprocessor_config.json"):
        if not (path / name).is_file():
            raise ConfigError("model.path", m.path, f"no {name} there: point it at a local Qwen2-VL folder "
                              "(config.json, *.safetensors, tokenizer files, preprocessor_config.json)")
    v.check()
    a.check()
    d.check()
    t.check()
    cfg.reward.check()
    if v.task == "files" and not d.train_files:
        raise ConfigError("data.train_files", [], "vlm.task=files reads its questions from data.train_files: list "
                          ".jsonl or .parquet files with a question, `answer` and `image` per row")
    if v.task != "files" and (d.train_files or d.val_files):
        field = "data.train_files" if d.train_files else "data.val_files"
        raise ConfigError(field, list(getattr(d, field.split(".")[1])), f"vlm.task={v.task} draws its questions "
                          "from the built-in task: remove it, or set vlm.task=files to train on these files")
    for field, value in (("data.train_batch_size", d.train_batch_size), ("vlm.val_items", v.val_items)):
        if value % t.n_workers:
            raise ConfigError(field, value, f"each of the trainer.n_workers={t.n_workers} workers takes an equal "
                              f"share of the questions: use a multiple of {t.n_workers}")
    check_number("rollout.n", r.n)
    check_number("trainer.total_training_steps", t.total_training_steps)  # the loop counts steps, not epochs
    if v.estimator in SEQUENCE_ESTIMATORS and r.n < 2:
        raise ConfigError("rollout.n", r.n, f"vlm.estimator={v.estimator} compares samples of one prompt: "
                          "use rollout.n >= 2")
    samples = d.train_batch_size * r.n
    mini = a.ppo_mini_batch_size or samples
    if mini > samples or samples % mini or mini % t.n_workers:
        raise ConfigError("actor.ppo_mini_batch_size", a.ppo_mini_batch_size,
                          f"must divide the {samples} responses of a step and be a multiple of trainer.n_workers "
                          f"({t.n_workers}); 0 = the whole batch")
    check_lr_schedule(cfg, frozen_steps=v.freezing_actor_steps)
