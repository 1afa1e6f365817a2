"""The rows a run trains and validates on, as `data:` names them, checked against the model
family and the batch before any worker starts: the number of source pictures each row gives, the
sizes rows are decoded at (`rollout.output_aspect`), the batches each number and size must fill,
and `data.source_weights`."""

from __future__ import annotations

from pathlib import Path

from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.errors import ConfigError
from pixelrl.algos.methods import method_of
from pixelrl.data.demonstrations import DemonstrationDataset
from pixelrl.data.preferences import PreferenceDataset
from pixelrl.data.prompts import PromptDataset


def datasets_of(cfg: PixelRLConfig):
    """(training set, validation set or None) as `cfg.data` names them: prompt files or inline
    prompts, preference pairs for offline sampling, or a supervised method's demonstrations."""
    d = cfg.data
    size = cfg.rollout.condition_size
    if cfg.algorithm.sample_source == "offline":
        if cfg.rollout.output_aspect != "square":
            raise ConfigError("rollout.output_aspect", cfg.rollout.output_aspect, "offline preference pairs are "
                              "read at rollout.resolution: leave it at square")
        train = PreferenceDataset.from_files(d.train_files, cfg.rollout.resolution, d.prompt_key, size,
                                             condition_fit=d.condition_fit)
        check_conditions(cfg, train, "data.train_files")
    elif method_of(cfg).trains_on_demonstrations:
        if cfg.rollout.output_aspect != "square":
            raise ConfigError("rollout.output_aspect", cfg.rollout.output_aspect, "demonstrations are read at "
                              "rollout.resolution: leave it at square")
        train = DemonstrationDataset.from_files(d.train_files, cfg.rollout.resolution, d.prompt_key, size,
                                                condition_fit=d.condition_fit)
        check_conditions(cfg, train, "data.train_files")
    else:
        train = (PromptDataset.from_files(d.train_files, d.prompt_key, size, condition_fit=d.condition_fit)
                 if d.train_files else PromptDataset.from_prompts(d.prompts))
        check_conditions(cfg, train, "data.train_files")
        check_reward_metadata(cfg, train, "data.train_files" if d.train_files else "data.prompts")
        if d.source_weights:
            check_source_weights(d.source_weights, {row["data_source"] for row in train.rows})
            train = train.weighted(d.source_weights)
        if cfg.rollout.output_aspect == "source" and d.train_files:
            train = train.keeping_aspects(source_sizer(cfg), d.train_batch_size)
        check_picture_batches(cfg, train)
    val = (PromptDataset.from_files(d.val_files, d.prompt_key, size, "data.val_files", condition_fit=d.condition_fit)
           if d.val_files else None)
    if val is not None:
        check_conditions(cfg, val, "data.val_files")
        check_reward_metadata(cfg, val, "data.val_files")
        if cfg.rollout.output_aspect == "source":
            val = val.keeping_aspects(source_sizer(cfg), 1)  # validation generates each size apart
    return train, val


def source_sizer(cfg: PixelRLConfig):
    """(width, height) -> the (height, width) a source of that shape is decoded at under
    rollout.output_aspect=source: its aspect at about condition_resolution (else resolution)
    squared pixels, the sides rounded as the family rounds an edit's output."""
    from pixelrl.core.assets import resolve
    from pixelrl.models.base import area_size
    from pixelrl.models.loader import model_family

    unit = model_family(cfg.model.type).edit_size_unit(Path(resolve(str(cfg.model.path))))
    side = cfg.rollout.condition_resolution or cfg.rollout.resolution
    return lambda width, height: area_size(side, width, height, unit)


def check_conditions(cfg: PixelRLConfig, dataset: PromptDataset, field: str) -> None:
    """Every row gives the number of condition images `model.type` takes (none for a
    text-to-image family), before any worker starts."""
    from pixelrl.models.loader import model_family

    from pixelrl.rewards.registry import REWARDS

    takes, most = model_family(cfg.model.type).condition_range()
    if cfg.rollout.condition_resolution and not takes:
        raise ConfigError("rollout.condition_resolution", cfg.rollout.condition_resolution,
                          f"sizes an edit family's condition images, and model.type={cfg.model.type} takes none: "
                          "leave it at 0")
    if cfg.rollout.output_aspect != "square" and not takes:
        raise ConfigError("rollout.output_aspect", cfg.rollout.output_aspect, f"gives each edit its source's aspect, "
                          f"and model.type={cfg.model.type} takes no source: leave it at square")
    if cfg.data.condition_fit != "crop" and not takes:
        raise ConfigError("data.condition_fit", cfg.data.condition_fit, f"fits an edit family's condition images to "
                          f"the output, and model.type={cfg.model.type} takes none: leave it at crop")

    def reads_sources(function: dict) -> bool:  # a reward whose options decide (remote) says so as a function
        reads = getattr(REWARDS.get(function["name"]), "reads_condition_images", False)
        return reads(dict(function.get("options") or {})) if callable(reads) else bool(reads)

    reading = [f["name"] for f in cfg.reward.functions if reads_sources(f)]
    if cfg.val_kwargs.gold_on_rollouts and (gold := [f["name"] for f in cfg.val_kwargs.rewards if reads_sources(f)]):
        raise ConfigError("val_kwargs.gold_on_rollouts", True, f"the gold rewards {gold} read the sources, which the "
                          "driver does not keep for a step's rollouts: score them at validation only (false)")
    if reading and not takes:
        raise ConfigError("reward.functions", reading, f"read each sample's source image, and model.type="
                          f"{cfg.model.type} edits none: use an edit family (model.type=flux_kontext or qwen_image_edit) with rows that "
                          "name an `image`, or another reward")
    counts = dataset.condition_counts()
    wrong = {n: rows for n, rows in counts.items() if not takes <= n <= most}
    if wrong:
        files = list(getattr(cfg.data, field.split(".")[1]))
        given = ", ".join(f"{rows} rows with {n}" for n, rows in sorted(wrong.items()))
        span = f"{takes}" if takes == most else f"{takes} to {most}"
        fix = ("remove `image` / `images` from the rows, or use an edit family (model.type=flux_kontext or qwen_image_edit)"
               if takes == 0 else f"give every row {span} (`image`, or `images` for several: paths relative to the file)")
        raise ConfigError(field, files, f"model.type={cfg.model.type} takes {span} condition image(s) per prompt, but "
                          f"the file has {given}: {fix}")


def check_reward_metadata(cfg: PixelRLConfig, dataset: PromptDataset, field: str) -> None:
    """A reward that judges from each row's metadata (the shapes detectors: what the scene or the
    edit asks) says what it needs (`metadata_problem`): every row is checked before any worker
    starts, so a file without it stops here, naming the data, not at the first step's reward."""
    from pixelrl.rewards.registry import REWARDS

    for function in cfg.reward.functions:
        problem_of = getattr(REWARDS.get(function["name"]), "metadata_problem", None)
        if problem_of is None:
            continue
        bad = [(row, problem) for row in dataset.rows if (problem := problem_of(row["metadata"]))]
        if bad:
            row, problem = bad[0]
            where = (f"{len(dataset.rows)} inline prompts" if field == "data.prompts"
                     else list(getattr(cfg.data, field.split(".")[1])))
            raise ConfigError(field, where, f"reward `{function['name']}` judges each image from its row's `metadata`, "
                              f"and {len(bad)} of {len(dataset.rows)} rows lack it (the row {row['prompt'][:60]!r}: "
                              f"{problem}): give every row that metadata (docs/shapes.md, 'Your own prompts', says what "
                              "it holds; builtin:shapes and builtin:shapes_edit rows carry it), or use another reward")


def check_picture_batches(cfg: PixelRLConfig, dataset: PromptDataset) -> None:
    """A batch holds training rows of one number of pictures (their condition latents stack), and
    under rollout.output_aspect=source of one size: a number with fewer rows than a batch (after
    data.source_weights, and after small sizes joined their nearest) would never be trained."""
    counts = dataset.bucket_counts()
    short = {key: rows for key, rows in counts.items() if rows < cfg.data.train_batch_size}
    if len(counts) > 1 and short:
        if dataset.row_sizes is not None:
            given = ", ".join(f"{rows} rows of {len(key)} picture(s) at "
                              + " + ".join(f"{w} x {h}" for h, w in key) for key, rows in sorted(short.items()))
            raise ConfigError("data.train_files", list(cfg.data.train_files), f"a batch holds rows of one size, and "
                              f"{given} px (width x height) have no size of their number of pictures with "
                              f"data.train_batch_size={cfg.data.train_batch_size} rows to join: add rows, lower "
                              "data.train_batch_size, or set rollout.output_aspect=square")
        given = ", ".join(f"{rows} rows with {n} picture(s)" for n, rows in sorted(short.items()))
        raise ConfigError("data.train_files", list(cfg.data.train_files), f"a batch holds rows of one number of "
                          f"pictures, and the training rows hold {given}, fewer than data.train_batch_size="
                          f"{cfg.data.train_batch_size}: add rows of that number, give those rows another number of "
                          "pictures, or lower data.train_batch_size")


def check_source_weights(weights: dict, sources: set[str]) -> None:
    """`data.source_weights` names sources of the training rows, with whole numbers >= 0, not all 0."""
    unknown = sorted(set(weights) - sources)
    if unknown:
        raise ConfigError("data.source_weights", dict(weights), f"no training row has data_source {unknown}; "
                          f"the training files' sources are {sorted(sources)}")
    bad = {k: v for k, v in weights.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    if bad:
        raise ConfigError("data.source_weights", dict(weights), f"{bad}: each weight is how many times a row of "
                          "that source appears per epoch, a whole number >= 0")
    if all(weights.get(source, 1) == 0 for source in sources):
        raise ConfigError("data.source_weights", dict(weights), "leaves no training row: give some source a weight >= 1")
