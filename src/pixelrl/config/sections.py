"""The run's configuration, composed from the sections their owners define and check
(`model:` in pixelrl.models, `rollout:` in pixelrl.sampling, `algorithm:` and `diffusion_loss:` in
pixelrl.algos, `reward:` in pixelrl.rewards, `data:` in pixelrl.data, `actor:` in pixelrl.engine),
plus the run's own sections: `trainer:` (the run folder, its schedule, its workers and mode,
read by the trainers, the workers and the CLI alike) and `val_kwargs:`.

A trainer with a loop of its own (the vision-language trainer) registers its own schema
(`SEPARATE_TRAINERS`): the sections every trainer shares, each holding only the fields that
trainer reads (`RunConfig`, `DataFilesConfig`, ... the bases of the diffusion sections), plus its
own (`vlm:`). A diffusion field in such a config is refused by name, and the reverse.

Leaf names follow verl / verl-omni where the meaning is the same (`rollout.n`,
`actor.ppo_mini_batch_size`, `diffusion_loss.clip_ratio`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pixelrl.algos.config import TRAINER_TYPE_ALIASES, AlgorithmConfig
from pixelrl.algos.methods import METHODS
from pixelrl.core.errors import ConfigError, check_choice, check_number
from pixelrl.core.registry import Registry
from pixelrl.data.config import DataConfig
from pixelrl.engine.config import EngineConfig
from pixelrl.engine.image_stats import WATCHABLE
from pixelrl.rewards.config import RewardConfig


def _default_drift_limits() -> dict[str, float]:
    # about three times the largest drift a normal shapes run shows (each in its own units:
    # shares and brightness 0..1, entropy in bits); the JPEG-hacked run crosses four of them
    # (docs/runtime.md, the reward-hacking watch, has both runs). A real model's normal drift
    # is its own: tune them per recipe
    return {"dark_fraction": 0.1, "brightness": 0.1, "saturation": 0.3, "colour_entropy": 0.5,
            "edge_density": 0.05, "grain": 0.03}


@dataclass
class HackingWatch:
    """`val_kwargs.hacking`: the rules that flag a validation as reward hacking suspected, each
    against the run's first validation (trainers/hacking.py; docs/runtime.md)."""

    enabled: bool = True
    # proxy up, gold down: the training reward's validation mean rose by more than proxy_rise
    # while a watched gold output fell by more than gold_drop (each in its own units)
    proxy_rise: float = 0.0
    gold_drop: float = 0.02
    # the gold outputs to watch (keys of val_kwargs.rewards' outputs, higher is better); [] =
    # each gold function's own-named output (shapes_geneval's shapes_geneval, ...)
    gold: list[str] = field(default_factory=list)
    # image and sample statistics (engine/image_stats.py) whose drift beyond these is flagged;
    # one not named, or .inf, is not watched
    drift: dict[str, float] = field(default_factory=_default_drift_limits)
    # diversity@n (val_kwargs.n > 1) below this fraction of the first validation's; 0 = not watched
    diversity_floor: float = 0.5

    def check(self, gold_rewards: list) -> None:
        for name in ("proxy_rise", "gold_drop"):
            check_number(f"val_kwargs.hacking.{name}", getattr(self, name), allow_zero=True, allow_inf=True)
        for name, limit in self.drift.items():
            check_choice("val_kwargs.hacking.drift", name, WATCHABLE)
            check_number(f"val_kwargs.hacking.drift.{name}", limit, allow_inf=True)
        if not 0 <= self.diversity_floor < 1:
            raise ConfigError("val_kwargs.hacking.diversity_floor", self.diversity_floor,
                              "a fraction of the first validation's diversity in [0, 1): 0.5 flags it halved, 0 is off")
        if self.gold and not gold_rewards:
            raise ConfigError("val_kwargs.hacking.gold", self.gold, "names gold outputs, and val_kwargs.rewards is "
                              "empty: add the gold rewards there (they are scored at every validation)")


@dataclass
class ValKwargs:
    n: int = 1  # images per validation prompt
    num_steps: int = 10
    noise_level: float = 0.0  # 0 = deterministic ODE sampling
    guidance_scale: float | None = None  # None = rollout.guidance_scale
    # euler: Euler steps (the ODE at noise 0), as AWM's and Flow-GRPO's references evaluate whatever
    # they sample with; dpm2: DPM-Solver++ 2M on rollout.sigma_schedule's grid, as DGPO's evaluates
    solver: str = "euler"
    # gold rewards: scored on the validation images besides the training reward (same format as
    # reward.functions), logged as val-core/<source>/gold/<key>/mean@n, so a training reward
    # that rises while a stricter judge stays flat shows up as it happens
    rewards: list = field(default_factory=list)
    # also score every training step's rollout images with them (in the driver; never trained
    # on), logged as critic/gold/<key>/mean: the proxy-vs-gold curve at every step
    gold_on_rollouts: bool = False
    # the weights validation samples with: auto, the EMA when actor.ema_decay > 0 (flow_grpo and
    # DiffusionNFT validate it), else the trained ones; old, the loss's old adapter (Flow-Factory's
    # off-policy NFT evaluates the EMA it samples rollouts with)
    weights: str = "auto"
    hacking: HackingWatch = field(default_factory=HackingWatch)

    def check(self) -> None:
        from pixelrl.rewards.config import check_reward_specs

        check_number("val_kwargs.n", self.n)
        check_number("val_kwargs.num_steps", self.num_steps)
        check_number("val_kwargs.noise_level", self.noise_level, allow_zero=True)
        check_choice("val_kwargs.solver", self.solver, ("euler", "dpm2"))
        check_choice("val_kwargs.weights", self.weights, ("auto", "old"))
        if self.solver == "dpm2" and self.noise_level > 0:
            raise ConfigError("val_kwargs.solver", self.solver, "DPM-Solver++ samples deterministically: set "
                              "val_kwargs.noise_level=0, or val_kwargs.solver=euler")
        if self.guidance_scale is not None:
            check_number("val_kwargs.guidance_scale", self.guidance_scale, allow_zero=True)
        check_reward_specs("val_kwargs.rewards", self.rewards)
        if self.gold_on_rollouts and not self.rewards:
            raise ConfigError("val_kwargs.gold_on_rollouts", True, "scores the rollouts with val_kwargs.rewards, and "
                              "it is empty: name the gold rewards there, e.g. [{name: shapes_geneval}]")
        self.hacking.check(self.rewards)


# fields a resume may change from its checkpoint's config when trainer.resume_changes names them
RESUME_CHANGEABLE = ("reward.functions", "data.train_files", "data.prompts", "data.source_weights")


@dataclass
class RunConfig:
    """What every trainer's `trainer:` section holds: the run folder, its schedule and its workers."""

    project_name: str = "pixelrl"
    experiment_name: str = "default"
    default_local_dir: str = "runs"  # the run folder is <default_local_dir>/<project>/<experiment>
    total_training_steps: int = 0
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb
    save_freq: int = 0  # 0 = only at the last step; -1 = never
    test_freq: int = 0  # 0 = only at the last step; -1 = never
    val_before_train: bool = False
    # stop after the step at which the summed step time of this process reaches this many
    # seconds, saving and validating as at the last step (0 = no budget)
    time_budget_s: float = 0.0
    resume_mode: str = "auto"  # auto | disable | <path to a global_step_N folder>
    # fields a resume may change from the checkpoint's config on purpose (a reward curriculum, new
    # prompts): any of reward.functions, data.train_files, data.prompts, data.source_weights.
    # Changing one without naming it here is refused
    resume_changes: list[str] = field(default_factory=list)
    # when a Ray worker's process dies (a native crash, the OOM killer, a lost node), start the
    # workers again and resume from the run's latest checkpoint, at most this many times (0 = stop)
    max_restarts: int = 0
    max_ckpt_to_keep: int = 0  # 0 = keep all
    # keep the checkpoint of the validation at which this metric was highest (saved even off
    # save_freq, never rotated away, named in <run>/checkpoints/best_checkpoint.json; `pixelrl demo`
    # evaluates it): a key of the validation row, e.g. val-aux/overall/shapes_strict/mean@4, the
    # mean over data sources. "" = off. Guards a long run against drifting past its peak.
    best_metric: str = ""
    backend: str = "ray"  # ray | local (one in-process worker, no Ray: for debugging)
    n_workers: int = 1  # actor workers over all nodes (one per GPU; on CPU each takes num_cpus_per_worker cores)
    num_cpus_per_worker: int = 1
    strategy: str = "ddp"  # ddp | fsdp2
    ray_address: str = ""  # "" = $RAY_ADDRESS or a local cluster; "auto" joins a running one
    # > 0: run this step under torch.profiler on every actor worker and write <run>/profile/
    # step_<N>_rank_<R>.txt (device time by kernel category and worker phase) and .json.gz (a
    # Chrome trace); 0 = off. Profiling slows the step it watches: its timing row is not the run's
    profile_step: int = 0

    def check(self) -> None:
        from pathlib import Path

        from pixelrl.core.paths import check_output_dir

        for name, value in (("save_freq", self.save_freq), ("test_freq", self.test_freq)):
            if value < -1:
                raise ConfigError(f"trainer.{name}", value, "steps between saves / validations: a positive number, "
                                  "0 (only at the last step) or -1 (never)")
        for name in ("project_name", "experiment_name"):  # one folder each, inside default_local_dir
            value = getattr(self, name)
            if not value or value in (".", "..") or "/" in value or "\\" in value:
                raise ConfigError(f"trainer.{name}", value, "one folder name (no slashes): the run folder is "
                                  "<trainer.default_local_dir>/<project_name>/<experiment_name>; set "
                                  "trainer.default_local_dir to put it elsewhere")
        check_choice("trainer.strategy", self.strategy, ("ddp", "fsdp2"))
        self._check_backend()
        self._check_best_metric()
        check_number("trainer.n_workers", self.n_workers)
        check_number("trainer.num_cpus_per_worker", self.num_cpus_per_worker)
        for name in ("time_budget_s", "profile_step", "total_training_steps"):
            check_number(f"trainer.{name}", getattr(self, name), allow_zero=True)
        for logger in self.logger:
            check_choice("trainer.logger", logger, ("console", "jsonl", "tensorboard", "wandb"))
        for name in self.resume_changes:
            check_choice("trainer.resume_changes", name, RESUME_CHANGEABLE)
        if self.resume_mode not in ("auto", "disable") and not Path(self.resume_mode).is_dir():
            raise ConfigError("trainer.resume_mode", self.resume_mode,
                              "use auto, disable, or the path of an existing global_step_N checkpoint folder")
        # every folder the run writes into can be made and written, checked before any worker
        # starts (a bad one would otherwise surface at the first checkpoint, after the work it was to keep)
        check_output_dir(self.default_local_dir, "trainer.default_local_dir")
        # the run folder itself (a link left by an earlier run to a folder since deleted)
        check_output_dir(Path(self.default_local_dir) / self.project_name / self.experiment_name,
                         "trainer.experiment_name")

    def _check_backend(self) -> None:
        """The local backend runs one worker in this process: a larger trainer.n_workers would be
        ignored there while the batch checks (and the user) count on it."""
        check_choice("trainer.backend", self.backend, ("ray", "local"))
        if self.backend == "local" and self.n_workers != 1:
            raise ConfigError("trainer.n_workers", self.n_workers, "trainer.backend=local runs one in-process worker: "
                              "set trainer.n_workers=1, or trainer.backend=ray for data parallelism")
        check_number("trainer.max_restarts", self.max_restarts, allow_zero=True)
        if self.backend == "local" and self.max_restarts:
            raise ConfigError("trainer.max_restarts", self.max_restarts, "restarts start Ray workers again after one "
                              "dies; the local backend's worker is this process: set trainer.backend=ray or 0")

    def _check_best_metric(self) -> None:
        """trainer.best_metric picks a checkpoint by a validation metric: it needs validations after
        training steps, and a validation key (training metrics are of one batch, not held out)."""
        if not self.best_metric:
            return
        if self.best_metric.split("/")[0] not in ("val-core", "val-aux", "val") or "/" not in self.best_metric:
            raise ConfigError("trainer.best_metric", self.best_metric, "name a validation metric, e.g. "
                              "val-aux/overall/shapes_strict/mean@4 (the mean over data sources), "
                              "val-core/<source>/reward/mean@<n>, or val/accuracy for the vision-language trainer")
        if self.test_freq == -1:
            raise ConfigError("trainer.best_metric", self.best_metric, "trainer.test_freq=-1 never validates: set "
                              "trainer.test_freq to how often (in steps) the best checkpoint is looked for")


@dataclass
class TrainerConfig(RunConfig):
    """The diffusion trainers' `trainer:` section: the run's, plus sampling ahead, dumps and grids,
    MFU and the memory fit."""

    total_training_steps: int = 0  # 0 = len(train loader) x total_epochs
    total_epochs: int = 1
    rollout_data_dir: str = ""  # dump each step's rollouts (JSONL + images) here when set
    validation_data_dir: str = ""  # dump validation generations here when set ("" = <run>/validation)
    log_image_grid_every: int = 0  # write a sample grid every N steps (0 = at validation only)
    # sync: batch i is sampled with the weights after step i - 1. one_step_off: with those after
    # step i - 2, so sampling batch i + 1 overlaps training on batch i. async: after step
    # i - 1 - max_staleness. The schedule is fixed, so async runs are reproducible and resume exactly.
    mode: str = "sync"
    max_staleness: int = 2  # async only: how many steps older than on-policy a batch's weights are
    # per-device peak for perf/mfu, in TFLOP/s (e.g. 989 for an H100's dense bf16); 0 = measure a
    # matmul peak on each actor worker at start-up, in the model's dtype
    peak_tflops: float = 0.0
    # GB per worker that the `auto` sizes (actor.ppo_micro_batch_size, model.gradient_checkpointing,
    # rollout.micro_batch_size) are chosen to fit at start-up, fastest first (what `pixelrl plan`
    # prints); 0 = the GPU's memory (the RAM on a CPU). With no size `auto`, > 0 chooses all three
    # and (several workers) trainer.strategy: a recipe written for other cards fitted to these
    fit_to_memory_gb: float = 0.0
    # stop the run, with a checkpoint, at the first validation that val_kwargs.hacking flags
    stop_when_hacking: bool = False
    # > 1: every sample's tokens split over this many consecutive actor workers (Ulysses: two
    # all-to-alls around each self-attention); they hold the same rows, so the rows of a step
    # split over trainer.n_workers / this. For long video sequences (wan)
    sequence_parallel_size: int = 1

    @property
    def data_workers(self) -> int:
        """Actor workers holding different rows (a sequence group's workers hold the same ones)."""
        return self.n_workers // self.sequence_parallel_size

    @property
    def data_workers_named(self) -> str:
        """How a message names `data_workers`."""
        return "trainer.n_workers" if self.sequence_parallel_size == 1 else \
            "trainer.n_workers / trainer.sequence_parallel_size"

    def check(self) -> None:
        from pixelrl.core.paths import check_output_dir

        super().check()
        check_choice("trainer.mode", self.mode, ("sync", "one_step_off", "async"))
        check_number("trainer.max_staleness", self.max_staleness, allow_zero=True)
        for name in ("peak_tflops", "fit_to_memory_gb", "log_image_grid_every"):
            check_number(f"trainer.{name}", getattr(self, name), allow_zero=True)
        check_number("trainer.total_epochs", self.total_epochs)
        check_number("trainer.sequence_parallel_size", self.sequence_parallel_size)
        if self.n_workers % self.sequence_parallel_size:
            raise ConfigError("trainer.sequence_parallel_size", self.sequence_parallel_size,
                              f"a sequence group is that many of the actor workers: use a size that divides "
                              f"trainer.n_workers={self.n_workers}")
        for name in ("rollout_data_dir", "validation_data_dir"):
            if getattr(self, name):
                check_output_dir(getattr(self, name), f"trainer.{name}")


@dataclass
class PixelRLConfig(EngineConfig):
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    # Modules or .py files imported in every process before anything is built: your own
    # rewards, losses, advantage estimators (README "Extending")
    plugins: list = field(default_factory=list)


def validation_guidance(cfg: PixelRLConfig) -> float:
    """The guidance scale validation samples with: `val_kwargs.guidance_scale`, or the rollouts'."""
    guidance = cfg.val_kwargs.guidance_scale
    return cfg.rollout.guidance_scale if guidance is None else guidance


@dataclass(frozen=True)
class SeparateTrainer:
    """A trainer with its own loop, sections and config checks, registered by its package (the
    vision-language trainer): `schema` is its config class (PixelRLConfig plus its sections),
    `check(cfg)` raises a ConfigError, `trainer_class()` imports and returns the trainer,
    `upgrade_saved(layer)` rewrites a saved config of an earlier schema in place (None: none),
    `diffusion_field_hints` says what to use instead of a diffusion field, where there is something,
    `training_metrics` what says how its training goes (as a `MethodSpec`'s)."""
    schema: type
    check: Callable[[PixelRLConfig], None]
    trainer_class: Callable[[], type]
    upgrade_saved: Callable | None = None
    diffusion_field_hints: dict = field(default_factory=dict)
    training_metrics: tuple[str, ...] = ("critic/rewards/mean",)


SEPARATE_TRAINERS: Registry = Registry("trainer type", "algorithm.trainer_type")


def schema_for(trainer_type: str) -> type:
    """The config class of a trainer type: PixelRLConfig, or a separate trainer's own."""
    if trainer_type in METHODS or trainer_type not in SEPARATE_TRAINERS:
        return PixelRLConfig  # an unknown type is reported by validation, with the known ones
    return SEPARATE_TRAINERS.get(trainer_type).schema


def training_metrics_of(trainer_type: str) -> tuple[str, ...]:
    """The metrics that say how a run of this trainer type trains: its method's, or its separate
    trainer's."""
    spec = SEPARATE_TRAINERS.get(trainer_type) if trainer_type in SEPARATE_TRAINERS else METHODS.get(trainer_type)
    return spec.training_metrics


def _current_trainer_type(layers: list, warn: bool) -> str:
    """algorithm.trainer_type as the layers set it, a former name (TRAINER_TYPE_ALIASES) replaced by
    its current one, with a warning for a user's config."""
    from pixelrl.core.config_io import layered_value

    given = str(layered_value(layers, "algorithm.trainer_type", AlgorithmConfig.trainer_type))
    current = TRAINER_TYPE_ALIASES.get(given, given)
    if warn and current != given:
        import warnings

        warnings.warn(f"algorithm.trainer_type={given} is the name used before 2026-11: it runs as {current}; "
                      "write that in your config", FutureWarning, stacklevel=3)
    return current


def _sections_of_other_trainers(layers: list, schema: type) -> dict[str, str]:
    """Top-level keys of the layers that are sections of another trainer's schema, each with
    that trainer's type."""
    from dataclasses import fields

    extra = {key for layer in layers for key in layer.keys()} - {f.name for f in fields(schema)}
    if not extra:  # the common case: no need to import the trainers that register their schemas
        return {}
    return {f.name: name for name in SEPARATE_TRAINERS.names() for f in fields(SEPARATE_TRAINERS.get(name).schema)
            if f.name in extra}


def merge_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The named YAML chain and the dotted overrides merged over the trainer type's schema, not
    yet checked (`pixelrl.config.load_config` imports the plugins and validates it)."""
    from pixelrl.core.config_io import build_config, config_layers
    from pixelrl.core.plugins import import_extensions

    import_extensions()  # an entry point: the trainer types and names the built-in extensions register
    layers = config_layers(config_name, overrides)
    trainer_type = _current_trainer_type(layers, warn=True)
    schema = schema_for(trainer_type)
    for section, owner in _sections_of_other_trainers(layers, schema).items():
        raise ConfigError(section, "<section>", f"configures algorithm.trainer_type={owner}, not {trainer_type}: "
                          "set that trainer type, or remove the section")
    try:
        cfg = build_config(schema, layers)
    except ConfigError as err:
        if schema is not PixelRLConfig and _is_diffusion_field(err.field):
            value = _layered(layers, err.field)
            # a whole section (val_kwargs: {...}) is named by its first key; a field stays itself
            name, value = _first_leaf(err.field, value) if "." not in err.field else (err.field, value)
            hint = SEPARATE_TRAINERS.get(trainer_type).diffusion_field_hints.get(name, "remove it")
            raise ConfigError(name, value, f"is read by the diffusion trainers only; algorithm.trainer_type="
                              f"{trainer_type} has its own schema without it: {hint}") from None
        raise
    cfg.algorithm.trainer_type = trainer_type
    return cfg


def _is_diffusion_field(dotted: str) -> bool:
    """Whether `dotted` (section.key...) names a field of the diffusion trainers' schema."""
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.structured(PixelRLConfig), dotted, default="<absent>") != "<absent>"


def _layered(layers: list, dotted: str):
    from omegaconf import OmegaConf

    from pixelrl.core.config_io import layered_value

    value = layered_value(layers, dotted, None)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _first_leaf(dotted: str, value) -> tuple[str, object]:
    """The first field set under the section `dotted`, with its value."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        dotted = f"{dotted}.{key}"
    return dotted, value


def _drop_fields_not_in(node, schema: type) -> None:
    """Remove from a saved config layer every key the schema lacks (a run saved while its
    trainer's schema carried every diffusion field)."""
    from dataclasses import fields, is_dataclass
    from typing import get_type_hints

    hints = get_type_hints(schema)
    names = {f.name for f in fields(schema)}
    for key in [k for k in node.keys() if k not in names]:
        node.pop(key)
    for f in fields(schema):
        if f.name in node and is_dataclass(hints[f.name]) and hasattr(node[f.name], "keys"):
            _drop_fields_not_in(node[f.name], hints[f.name])


def from_yaml_text(text: str) -> PixelRLConfig:
    """A config as `saved_yaml` wrote it into a run folder or checkpoint. A section the trainer's
    schema no longer has (a diffusion run saved while every config carried `vlm:`) is dropped."""
    from pixelrl.core.config_io import build_config, saved_layer
    from pixelrl.core.plugins import import_extensions

    import_extensions()  # an entry point, as merge_config
    layer = saved_layer(text)
    trainer_type = _current_trainer_type([layer], warn=False)
    schema = schema_for(trainer_type)
    for section in _sections_of_other_trainers([layer], schema):
        layer.pop(section)
    if schema is not PixelRLConfig:  # validated when saved: what the schema no longer holds was never read
        upgrade = SEPARATE_TRAINERS.get(trainer_type).upgrade_saved
        if upgrade is not None:
            upgrade(layer)
        _drop_fields_not_in(layer, schema)
    cfg = build_config(schema, [layer])
    cfg.algorithm.trainer_type = trainer_type
    return cfg
