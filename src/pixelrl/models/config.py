"""The `model:` section: which pipeline folder, on which device, in which dtype, with which adapter."""

from __future__ import annotations

from dataclasses import dataclass

from pixelrl.core.errors import AUTO, ConfigError, check_choice, check_number


@dataclass
class ModelFolderConfig:
    """What every trainer's `model:` section holds: a local model folder, where it runs, and the
    adapter trained on it."""

    path: str = ""  # local model folder
    type: str = "sd3"
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype; log-prob math is always float32
    lora_rank: int = 32  # 0 = full fine-tuning
    lora_alpha: float = 64.0
    lora_target_modules: list[str] | None = None  # None = the adapter's defaults


@dataclass
class ModelConfig(ModelFolderConfig):
    """The diffusion trainers' `model:` section: a diffusers pipeline folder, its text length and
    frames, the adapter's initialisation, and how the denoiser runs."""

    max_sequence_length: int = 256  # T5 tokens (or zero tokens when the folder has no T5)
    num_frames: int = 1  # frames per sample: 1 for image families; video families (wan) 4k + 1, e.g. 33 or 81
    lora_init: str = "gaussian"  # gaussian | default (peft's kaiming A, zero B) | pissa | olora | orthogonal
    gradient_checkpointing: bool | str = False  # auto: on only where the step fits, or runs faster, with it
    # torch.compile each of the denoiser's repeated blocks (sampling, reference and training):
    # compiled per block structure, adapter state and grad mode on the first steps, then reused.
    # auto: on a CUDA device only (see `compiles`)
    compile: bool | str = False
    # a denoiser of two experts (a Wan 2.2 A14B folder): the low-noise expert's CFG scale, the
    # pipeline's guidance_scale_2 (None = the high-noise expert's, rollout.guidance_scale), and which
    # experts train (`transformer` high noise, `transformer_2` low noise; None = both)
    guidance_scale_2: float | None = None
    trained_experts: list[str] | None = None

    def check(self) -> None:
        """The fields on their own (the folder is checked last by `check_folder`: a config copied
        from another machine reports its field errors before its missing path)."""
        from pixelrl.models.base import DTYPES
        from pixelrl.models.loader import MODEL_TYPES
        from pixelrl.models.lora import LORA_INITS

        check_choice("model.type", self.type, MODEL_TYPES.names())
        check_choice("model.dtype", self.dtype, sorted(DTYPES))
        check_choice("model.lora_init", self.lora_init, LORA_INITS)
        check_number("model.lora_rank", self.lora_rank, allow_zero=True)
        check_number("model.lora_alpha", self.lora_alpha)
        check_number("model.max_sequence_length", self.max_sequence_length, allow_zero=True)
        if self.compile not in (True, False, AUTO):
            raise ConfigError("model.compile", self.compile, f"true, false or {AUTO} (compiles the denoiser's "
                              "blocks on a CUDA device, where it pays for its compile time within a run's first "
                              "few dozen steps)")
        if self.gradient_checkpointing not in (True, False, AUTO):
            raise ConfigError("model.gradient_checkpointing", self.gradient_checkpointing, f"true, false or {AUTO} "
                              "(chosen at start-up with the micro-batches: on only where the step fits, or runs "
                              "faster, with it)")

    def compiles(self) -> bool:
        """Whether the denoiser's blocks are compiled. `auto` compiles on a CUDA device: on one H200
        the SD3.5-M Flow-GRPO step ran 1.5x faster for about 95 s of compiling once
        (docs/benchmarks.md), while on a CPU the tiny models gain about 10% for a compile that
        takes longer than a short run."""
        if self.compile == AUTO:
            import torch

            return torch.device(self.device).type == "cuda"
        return bool(self.compile)

    def _check_experts(self, folder) -> None:
        from pixelrl.models.loader import model_family

        experts = model_family(self.type).expert_names(folder)
        for field in ("guidance_scale_2", "trained_experts"):
            if getattr(self, field) is not None and not experts:
                raise ConfigError(f"model.{field}", getattr(self, field), "this model folder has one denoiser (no "
                                  "second expert and boundary_ratio in its model_index.json): leave it unset")
        if self.guidance_scale_2 is not None:
            check_number("model.guidance_scale_2", self.guidance_scale_2)
        if self.trained_experts is not None:
            chosen = list(self.trained_experts)
            if not chosen or len(set(chosen)) != len(chosen) or not set(chosen) <= set(experts):
                raise ConfigError("model.trained_experts", chosen, f"name one or both of {list(experts)} (the "
                                  "high-noise and the low-noise expert), each once; unset trains both")

    def check_folder(self) -> None:
        """The pipeline folder exists, holds this family, and agrees with the options it was
        trained with (its pixelrl_model.json)."""
        from pathlib import Path

        from pixelrl.core.assets import resolve
        from pixelrl.models.loader import check_model_type, declared_options

        if not Path(resolve(str(self.path))).is_dir():
            what = "is a file, not a folder" if Path(resolve(str(self.path))).is_file() else "the folder does not exist"
            raise ConfigError("model.path", self.path, f"{what}: set model.path to a local diffusers pipeline folder "
                              "(the one holding model_index.json; or builtin:shapes; `pixelrl build-tiny DIR` makes a "
                              "tiny random one)")
        check_model_type(self.type, self.path)
        self._check_experts(Path(resolve(str(self.path))))
        for option, value in declared_options(self.path).items():
            if getattr(self, option) != value:
                raise ConfigError(f"model.{option}", getattr(self, option), f"the model folder was trained with "
                                  f"{value} (its pixelrl_model.json): set model.{option}={value}")
