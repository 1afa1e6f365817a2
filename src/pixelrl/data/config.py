"""The `data:` section: where prompts come from and how many a step takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pixelrl.core.errors import ConfigError, check_choice, check_number


@dataclass
class DataFilesConfig:
    """What every trainer's `data:` section holds: row files, and how many rows a step takes."""

    train_files: list[str] = field(default_factory=list)  # jsonl / parquet / txt
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 8  # prompts per step (each repeated rollout.n times)
    shuffle: bool = True
    seed: int = 1

    def check(self) -> None:
        check_number("data.train_batch_size", self.train_batch_size)


@dataclass
class DataConfig(DataFilesConfig):
    """The diffusion trainers' `data:` section: prompt files or inline prompts, weighted by source."""

    prompts: list[str] = field(default_factory=list)  # inline prompts, used when no train file is given
    # {data_source: k}: every training row of that source appears k times per epoch (unlisted
    # sources once; 0 leaves a source out), to train more on what the model is weakest at
    source_weights: dict = field(default_factory=dict)
    val_batch_size: int = 0  # prompts per validation generation call; 0 = the whole set at once
    # how an edit row's source of another aspect than the output is fitted to it: crop (its
    # largest centred crop) | pad (all of it, centred on white, as verl-omni letterboxes its edit
    # data) | stretch (all of it, resized to the output's shape, as flow_grpo's edit scripts)
    condition_fit: str = "crop"

    def check(self) -> None:
        from pixelrl.data.prompts import CONDITION_FITS

        super().check()
        check_choice("data.condition_fit", self.condition_fit, CONDITION_FITS)
        check_number("data.val_batch_size", self.val_batch_size, allow_zero=True)  # 0 = the whole set at once
        if not self.train_files and self.prompts and any(not str(p).strip() for p in self.prompts):
            raise ConfigError("data.prompts", list(self.prompts), "an inline prompt is empty or blank: give each "
                              "prompt some text, or read prompts from data.train_files")
