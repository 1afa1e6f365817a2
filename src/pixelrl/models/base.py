"""The small interface every text-to-image adapter implements.

Sampling and training code only talk to this interface, so SD3.5, FLUX, Qwen-Image and the
shipped tiny model share one rollout loop and one update step.
"""

from __future__ import annotations

import copy
import functools
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


# The attention projections of a joint-attention block, image stream and text stream (SD3's joint
# blocks, FLUX's double-stream blocks, Qwen-Image's blocks): the LoRA targets the references train.
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        from pixelrl.core.errors import ConfigError

        raise ConfigError("model.dtype", name, f"choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class PromptEmbeds:
    """A batch's condition as the denoiser takes it: text sequence embeddings, pooled vectors
    (SD3, FLUX), for families whose prompts encode to different lengths (Qwen-Image) a token mask,
    and for image-conditioned families (editing) the condition images' clean latents."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor | None = None  # [B, P]
    mask: torch.Tensor | None = None  # [B, L], 1 for a real token, 0 for padding
    condition_latents: torch.Tensor | None = None  # [B, n images, *latent], model space

    def __len__(self) -> int:
        return self.embeds.shape[0]

    @staticmethod
    def cat(parts: list["PromptEmbeds"]) -> "PromptEmbeds":
        """One batch; with masks, shorter sequences are zero-padded (and masked) to the longest."""
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        images = None if parts[0].condition_latents is None else torch.cat([p.condition_latents for p in parts])
        if parts[0].mask is None:
            return PromptEmbeds(torch.cat([p.embeds for p in parts]), pooled, condition_latents=images)
        length = max(p.embeds.shape[1] for p in parts)
        pad = [length - p.embeds.shape[1] for p in parts]
        embeds = torch.cat([torch.nn.functional.pad(p.embeds, (0, 0, 0, n)) for p, n in zip(parts, pad)])
        mask = torch.cat([torch.nn.functional.pad(p.mask, (0, n)) for p, n in zip(parts, pad)])
        return PromptEmbeds(embeds, pooled, mask, images)


class DiffusionModel(ABC):
    """A flow-matching text-to-image model: denoiser, text encoders, scheduler, decoder.

    A model family (one folder under `models/`) subclasses this and owns everything specific to
    it: the diffusers pipeline it stands for (prompt encoding, LoRA file layout, export), the
    conditioning its denoiser takes, the latent layout, the sigma schedule and the FSDP units.
    Sampling, engines and trainers only call the methods below."""

    transformer: nn.Module  # the denoiser; the only module that is ever trained
    scheduler: object  # a diffusers FlowMatchEulerDiscreteScheduler (or compatible)
    device: torch.device
    dtype: torch.dtype  # compute dtype of the denoiser
    default_lora_targets: tuple[str, ...] = ()
    # the diffusers pipeline class this family stands for (`_class_name` in model_index.json)
    pipeline_class_name: str = ""
    # classifier-free guidance as a second (negative-prompt) branch; False for guidance-distilled
    # families, whose denoiser takes the guidance scale as an input
    uses_negative_prompt: bool = True
    # how the family's diffusers pipeline call names that guidance (QwenImagePipeline: true_cfg_scale)
    # and what it returns (WanPipeline: frames)
    diffusers_guidance_argument: str = "guidance_scale"
    diffusers_output: str = "images"
    # families conditioned on text-encoder token states refuse model.max_sequence_length <= 0 with
    # this fix; None where zero tokens is meaningful (SD3 without T5)
    text_tokens_hint: str | None = None

    # condition images a sample takes besides its text (0: text-to-image; 1: an edit family), and
    # the most it can take (None: exactly condition_images); every sample of a batch takes as many
    condition_images: int = 0
    most_condition_images: int | None = None
    # an edit pipeline call's arguments, beside height and width, that keep the output and its
    # source at the trained size ({area}: the trained resolution squared)
    diffusers_edit_size: str = ""

    @classmethod
    def condition_range(cls) -> tuple[int, int]:
        """(fewest, most) condition images a sample of this family takes."""
        return cls.condition_images, cls.most_condition_images or cls.condition_images

    # the side of the latent patch one denoiser token packs, for rescales that act per token
    # (DMD2's teacher `cfg_norm: layer_norm`): 1 where the denoiser takes unpacked latents
    guidance_token_patch: int = 1

    # An edit's output takes its source's aspect at about the requested area, each side rounded to
    # this many px (QwenImageEditPlusPipeline's calculate_dimensions: 32); 0: the folder's latent unit
    output_side_rounding: int = 0
    # which source sets the output's aspect: QwenImageEditPlusPipeline takes its last picture's
    aspect_source_index: int = 0

    @classmethod
    def edit_size_unit(cls, folder: Path) -> int:
        """The px an edit output's sides are rounded to for this folder (its config files alone)."""
        return max(cls.output_side_rounding, cls.latent_unit(Path(folder)) or 1)

    def edit_output_size(self, side: int, source_width: int, source_height: int) -> tuple[int, int]:
        """(height, width) of an edit's output: about side x side pixels in the source's aspect,
        each side rounded to the family's unit (at least one unit)."""
        return area_size(side, source_width, source_height, self._edit_unit)

    @functools.cached_property
    def _edit_unit(self) -> int:
        """edit_size_unit of this folder, its config files read once (not on every rollout call)."""
        return type(self).edit_size_unit(Path(self.path))

    # full fine-tuning of a low-precision model: float32 denoiser weights, forwards under autocast
    float32_master_weights: bool = False

    def __init__(self, prompt_cache_size: int = 4096):
        self._prompt_cache: OrderedDict[str, PromptEmbeds] = OrderedDict()
        self._prompt_cache_size = prompt_cache_size
        self._image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def keep_float32_master_weights(self) -> None:
        """For full fine-tuning: the denoiser trains float32 weights under autocast to `dtype`
        (`pixelrl.models.kernels.float32_master_weights`)."""
        from pixelrl.models.kernels import float32_master_weights

        self.float32_master_weights = float32_master_weights(self.transformer, self.dtype)

    def compute_precision(self):
        """The context every denoiser forward runs in: autocast to `dtype` over float32 master
        weights, nothing otherwise."""
        from pixelrl.models.kernels import master_weights_autocast

        return master_weights_autocast(self.device, self.dtype, self.float32_master_weights)

    # --- loading (used by each family's __init__) --------------------------------------------
    def _open(self, path, required: tuple[str, ...], device, dtype, max_sequence_length: int,
              num_frames: int = 1) -> Path:
        """Check the folder and the options; set path, device, dtype and max_sequence_length."""
        folder = check_pipeline_folder(path, required, pipeline=self.pipeline_class_name)
        self.check_options(max_sequence_length, num_frames, folder)
        self.path, self.device, self.dtype = folder, torch.device(device), resolve_dtype(dtype)
        self.max_sequence_length = int(max_sequence_length)
        return folder

    def _load_module(self, folder: Path, part: str, cls, *, frozen: bool = True) -> nn.Module:
        """`cls.from_pretrained(folder/part)` from safetensors, in the model's dtype on its device,
        without gradients, its RMS norms fused; frozen parts (text encoders, VAE) also in eval mode."""
        from pixelrl.models.kernels import fuse_rms_norms

        module = load_part(folder, f"{part}/", lambda: cls.from_pretrained(
            folder / part, torch_dtype=self.dtype, use_safetensors=True)).to(self.device).requires_grad_(False)
        fuse_rms_norms(module)
        return module.eval() if frozen else module

    @staticmethod
    def _load_scheduler(folder: Path):
        """The folder's flow-matching scheduler (every family here samples with this one)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return load_part(folder, "scheduler/", lambda: FlowMatchEulerDiscreteScheduler.from_pretrained(
            folder / "scheduler"))

    # --- the family's diffusers pipeline (class-level: export needs no loaded model) ---------
    @classmethod
    def pipeline_class(cls):
        import diffusers

        return getattr(diffusers, cls.pipeline_class_name)

    @classmethod
    def load_pipeline(cls, folder: Path):
        """The diffusers pipeline of a model folder, as `from_pretrained` loads it (export)."""
        return load_part(folder, "pipeline", lambda: cls.pipeline_class().from_pretrained(folder, use_safetensors=True))

    @classmethod
    def save_pipeline(cls, pipeline, folder: Path) -> None:
        """Write a pipeline `load_pipeline` returned as a diffusers folder (export)."""
        pipeline.save_pretrained(folder, safe_serialization=True)

    @classmethod
    def save_lora(cls, folder: Path, lora: dict[str, torch.Tensor], config: dict) -> None:
        """Write a denoiser LoRA (peft key names) where the pipeline's `load_lora_weights` reads it.
        `config` (the adapter's peft LoraConfig as a dict) goes into the file's metadata: without it
        diffusers assumes lora_alpha = rank and would apply the adapter at the wrong scale."""
        cls.pipeline_class().save_lora_weights(folder, transformer_lora_layers=lora, safe_serialization=True,
                                               transformer_lora_adapter_metadata=config)

    @classmethod
    def fuse_lora_into_pipeline(cls, pipeline, folder: Path) -> None:
        """Fuse an adapter folder `save_lora` wrote into the pipeline's weights (export)."""
        pipeline.load_lora_weights(folder)
        pipeline.fuse_lora()
        pipeline.unload_lora_weights()

    @classmethod
    def denoiser_state_into_pipeline(cls, pipeline, state: dict[str, torch.Tensor]) -> list[str]:
        """Load a full fine-tune's denoiser tensors into the pipeline; the names that fit nothing."""
        return pipeline.transformer.load_state_dict(state, strict=False)[1]

    @classmethod
    def expert_names(cls, folder: Path) -> tuple[str, ...]:
        """The pipeline components of a denoiser of several experts (Wan 2.2 A14B); none here."""
        return ()

    @classmethod
    def check_trained_steps(cls, folder: Path, trained_experts: list[str] | None, num_steps: int,
                            steps: range) -> None:
        """Refuse a range of trained denoising steps that only frozen experts compute (it would
        train nothing); one denoiser computes every step."""

    @classmethod
    def check_options(cls, max_sequence_length: int, num_frames: int = 1, folder: Path | None = None) -> None:
        """Refuse `model.*` options this family cannot use (config validation calls it, with the
        folder when it exists). Image families sample one frame."""
        from pixelrl.core.errors import ConfigError

        cls.check_text_tokens(max_sequence_length)
        if num_frames != 1:
            raise ConfigError("model.num_frames", num_frames, f"{cls.pipeline_class_name} makes images: use 1 "
                              "(only video families such as model.type=wan take more frames)")

    @classmethod
    def check_text_tokens(cls, max_sequence_length: int) -> None:
        if cls.text_tokens_hint is not None and max_sequence_length <= 0:
            from pixelrl.core.errors import ConfigError

            raise ConfigError("model.max_sequence_length", max_sequence_length, cls.text_tokens_hint)

    @classmethod
    def latent_unit(cls, folder: Path) -> int | None:
        """The pixel multiple an image side must be for this folder, from its config files alone
        (no weights loaded); None when the folder cannot tell (loading it reports why)."""
        return None

    @classmethod
    def max_side(cls, folder: Path) -> int | None:
        """The largest image side this folder's denoiser has positions for, from its config files;
        None when it has no such limit (rotary positions) or the folder cannot tell."""
        return None

    # --- schedule and parallelism ---------------------------------------------------------
    def image_seq_len(self, height: int, width: int) -> int:
        """Image tokens the denoiser sees at this resolution (resolution-dependent shifting)."""
        raise NotImplementedError(f"{type(self).__name__} does not define image_seq_len")

    def sequence_tokens(self, latents: torch.Tensor) -> int:
        """The length of the token sequence a sequence-parallel group splits, for these latents."""
        raise NotImplementedError(f"{type(self).__name__} has no sequence split")

    def default_resolution(self) -> int | None:
        """The image side the family's diffusers pipeline samples at when given none (its
        `default_sample_size` latents x the VAE's scale); None when the pipeline has no single one."""
        size = getattr(getattr(self, "pipeline", None), "default_sample_size", None)
        scale = getattr(self, "vae_scale", None)
        return int(size) * int(scale) if size and scale else None

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The N + 1 sigmas the family's own scheduler uses at this resolution."""
        seq_len = self.image_seq_len(height, width) if getattr(self.scheduler.config, "use_dynamic_shifting",
                                                               False) else None
        return sigmas_from_scheduler(self.scheduler, num_steps, seq_len)

    def fsdp_units(self) -> list[nn.Module]:
        """The denoiser's FSDP all-gather units: the blocks diffusers declares unsplittable."""
        from pixelrl.parallel.fsdp import no_split_units

        return no_split_units(self.transformer)

    # --- text -----------------------------------------------------------------------------
    @abstractmethod
    def _encode_uncached(self, prompts: list[str]) -> PromptEmbeds:
        """Run the frozen text encoders on `prompts` (no grad)."""

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings for `prompts`, encoding each distinct string once and caching it (LRU).

        A prompt is encoded on its own: batched matmuls round differently with the batch's
        size, so a prompt's embedding would depend on which prompts missed the cache with it,
        and a resumed run (empty cache) would drift from an uninterrupted one in the last bit.
        """
        return self._cached_embeds(prompts, lambda prompt: self._encode_uncached([prompt]))

    def _cached_embeds(self, keys: list, encode_one) -> PromptEmbeds:
        """`encode_one(key)` for each distinct key the cache lacks, then the keys' embeddings in
        order (the LRU cache shared by text and text-with-image keys)."""
        missing = list(dict.fromkeys(k for k in keys if k not in self._prompt_cache))
        with torch.no_grad():
            for k in missing:
                self._prompt_cache[k] = encode_one(k)
        parts = []
        for k in keys:
            self._prompt_cache.move_to_end(k)
            parts.append(self._prompt_cache[k])
        while len(self._prompt_cache) > self._prompt_cache_size:
            self._prompt_cache.popitem(last=False)
        return PromptEmbeds.cat(parts)

    def encode_conditions(self, prompts: list[str], images: list | None = None) -> PromptEmbeds:
        """The batch's conditions: each prompt's text embeddings and, for an image-conditioned
        family, row i's condition images (`images[i]`: a tuple of uint8 [H, W, 3] tensors) as
        clean latents. Each image is encoded alone and cached by its content, so a sample's
        condition latents are the same bits in its rollout, every re-score and every teacher,
        whatever the micro-batch around it."""
        if images is None and self.condition_images:
            raise ValueError(f"{type(self).__name__} samples from a condition image per prompt and these rows carry "
                             "none: every forward of an edit family needs the rows' condition_images")
        if images is None or self.condition_images == 0 and not any(images):
            return self.encode_prompts(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} rows of condition images")
        counts = {len(row) for row in images}
        fewest, most = self.condition_range()
        if len(counts) != 1 or not fewest <= min(counts) <= most:
            from pixelrl.core.errors import ConfigError

            takes = f"{fewest}" if fewest == most else f"{fewest} to {most}"
            raise ConfigError("data.train_files", f"{sorted(counts)} condition images per row",
                              f"{type(self).__name__} ({self.pipeline_class_name}) takes {takes} per sample, the "
                              "same number on every row of a batch: give each row that many (`image` / `images`)")
        keys = [tuple(map(self._image_key, row)) for row in images]  # each source hashed once per call
        text = self._encode_text_seeing(prompts, images, keys)
        latents = torch.stack([torch.stack([self._condition_latents(image, key) for image, key in zip(row, row_keys)])
                               for row, row_keys in zip(images, keys)])
        return PromptEmbeds(text.embeds, text.pooled, text.mask, latents)

    def _encode_text_seeing(self, prompts: list[str], images: list, keys: list[tuple[str, ...]]) -> PromptEmbeds:
        """The text embeddings of an edit batch (`keys`: each row's image content keys): the text
        alone, unless the family's text encoder also reads the condition images (Qwen-Image-Edit)."""
        return self.encode_prompts(prompts)

    @staticmethod
    def _image_key(image: torch.Tensor) -> str:
        import hashlib

        image = image.contiguous()
        return f"{tuple(image.shape)}:{hashlib.sha1(image.numpy().tobytes()).hexdigest()}"

    def _condition_latents(self, image: torch.Tensor, key: str) -> torch.Tensor:
        if key not in self._image_cache:
            with torch.no_grad():
                self._image_cache[key] = self.encode(image.unsqueeze(0))[0]
        self._image_cache.move_to_end(key)
        while len(self._image_cache) > self._prompt_cache_size:
            self._image_cache.popitem(last=False)
        return self._image_cache[key]

    def negative_embeds(self, negative_prompt: str, batch: int, guidance_scale: float,
                        condition_images: list | None = None) -> PromptEmbeds | None:
        """The unconditional branch's embeddings, when this guidance scale needs one: the negative
        prompt under the rows' condition images (both branches of an edit see the source)."""
        if guidance_scale == 1.0 or not self.uses_negative_prompt:
            return None
        return self.encode_conditions([negative_prompt] * batch, condition_images)

    # --- denoiser -------------------------------------------------------------------------
    @abstractmethod
    def _forward(self, latents: torch.Tensor, sigmas: torch.Tensor, text: PromptEmbeds) -> torch.Tensor:
        """One denoiser forward: latents in model dtype, sigmas [B] in [0, 1]; returns velocity."""

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        text: PromptEmbeds,
        *,
        guidance_scale: float = 1.0,
        negative: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """Velocity in float32. With guidance > 1 both branches run in ONE batched forward:
        v = v_uncond + w (v_cond - v_uncond)."""
        x = latents.to(self.dtype)
        sig = sigmas.to(device=latents.device, dtype=torch.float32).expand(latents.shape[0])
        if guidance_scale == 1.0 or negative is None:
            with self.compute_precision():
                return self._forward(x, sig, text).float()
        both = PromptEmbeds.cat([negative, text])
        with self.compute_precision():
            v = self._forward(torch.cat([x, x]), torch.cat([sig, sig]), both).float()
        v_uncond, v_cond = v.chunk(2)
        return v_uncond + self.guidance_weight(sig, guidance_scale) * (v_cond - v_uncond)

    def guidance_weight(self, sigmas: torch.Tensor, guidance_scale: float):
        """The CFG scale each row is guided with (a family whose denoiser changes with the
        timestep, Wan 2.2's experts, may give each its own)."""
        return guidance_scale

    def denoiser_networks(self) -> list[nn.Module]:
        """The diffusers transformers `self.transformer` runs (two for a two-expert family): what a
        sequence split installs itself on."""
        return [self.transformer]

    # --- images ---------------------------------------------------------------------------
    @abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample latent shape for an image of this resolution."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 images [B, H, W, 3] on CPU."""

    @abstractmethod
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images [B, H, W, 3] -> clean latents x0 (float32, on the model's device), the
        inverse of `decode` up to the autoencoder's error."""

    # --- training helpers -----------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]


def from_uint8_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> [-1, 1] float32 channel-first images (the inverse of to_uint8_images)."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def area_size(side: int, width: int, height: int, unit: int) -> tuple[int, int]:
    """(height, width) of about side x side pixels in the aspect width : height, each side rounded
    to a multiple of `unit` (at least one): QwenImageEditPlusPipeline's calculate_dimensions at
    unit 32."""
    import math

    ratio = width / height
    out_w = round(math.sqrt(side * side * ratio) / unit) * unit
    out_h = round(math.sqrt(side * side / ratio) / unit) * unit
    return max(unit, out_h), max(unit, out_w)


def to_uint8_images(pixels: torch.Tensor) -> torch.Tensor:
    """[-1, 1] channel-first float images -> uint8 [B, H, W, 3] (rounded, clamped)."""
    x = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu()


def check_resolution(height: int, width: int, unit: int) -> None:
    """A ConfigError naming rollout.resolution unless both sides are multiples of `unit`."""
    if height % unit or width % unit:
        from pixelrl.core.errors import ConfigError

        raise ConfigError("rollout.resolution", (height, width), f"height and width must be multiples of {unit}")


def sigmas_from_scheduler(scheduler, num_steps: int, image_seq_len: int | None = None,
                          grid: list[float] | None = None) -> torch.Tensor:
    """The N + 1 sigmas (ending in 0) that `scheduler` uses for `num_steps` steps.

    The scheduler is copied so that callers never mutate the model's own instance. Schedulers
    with resolution-dependent shifting (FLUX, Qwen-Image) need `image_seq_len` to compute `mu`,
    as their pipelines do with `calculate_shift`. `grid` is the unshifted sigma grid a pipeline
    passes (FLUX: linspace(1, 1/N, N)); without it the scheduler spaces its own.
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
    if grid is not None:
        kwargs["sigmas"] = list(grid)
    sched.set_timesteps(num_steps, device="cpu", **kwargs)
    sigmas = sched.sigmas.detach().to(torch.float32).cpu()
    if sigmas.shape[0] != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"expected {num_steps + 1} sigmas ending in 0 from the scheduler, got {sigmas.tolist()}")
    return sigmas


def check_pipeline_folder(path: str | Path, required=("transformer", "scheduler"), *, pipeline: str = "") -> Path:
    """The folder as a Path, or one ModelFolderError naming what is missing."""
    from pixelrl.core.errors import ModelFolderError

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFolderError(
            f"model folder `{folder}` does not exist: set model.path to a local diffusers pipeline folder "
            f"(e.g. one saved by `{pipeline or 'DiffusionPipeline'}.save_pretrained`)")
    missing = [name for name in required if not (folder / name / "config.json").is_file()
               and not (folder / name / "scheduler_config.json").is_file()]
    if missing:
        raise ModelFolderError(
            f"model folder `{folder}` lacks the component folder(s) {missing} (each needs its config file): "
            f"point model.path at the root of a diffusers pipeline folder")
    return folder


def read_component_config(folder: Path, part: str) -> dict | None:
    """`folder/part/config.json` as a dict, or None when it is not there or not JSON."""
    file = folder / part / "config.json"
    try:
        return json.loads(file.read_text()) if file.is_file() else None
    except (OSError, ValueError):
        return None


def vae_scale_factor(folder: Path) -> int:
    """How many pixels one latent cell spans (1 for a pixel-space folder without a VAE)."""
    vae = read_component_config(folder, "vae")
    return 2 ** (len(vae.get("block_out_channels", [0])) - 1) if vae else 1


@torch.no_grad()
def vae_decode(vae, latents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Model-space latents -> uint8 images through a diffusers AutoencoderKL (its scaling and
    shift factors undone first)."""
    cfg = vae.config
    z = latents.to(dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
    return to_uint8_images(vae.decode(z, return_dict=False)[0])


@torch.no_grad()
def vae_encode(vae, images: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 images -> model-space latents: the posterior mean (not a sample), so the same image
    always gives the same x0 and a resumed run sees the latents an uninterrupted one saw."""
    cfg = vae.config
    z = vae.encode(from_uint8_images(images).to(device, dtype)).latent_dist.mode()
    return ((z.float() - (cfg.shift_factor or 0.0)) * cfg.scaling_factor).float()


def load_part(folder, part: str, load):
    """`load()` one component of a model folder; a missing, truncated or corrupted file in it (or a
    config that does not match its weights) becomes one ModelFolderError naming the part and the
    cause, instead of a library traceback from deep inside from_pretrained."""
    from safetensors import SafetensorError

    from pixelrl.core.errors import ModelFolderError

    try:
        loaded = load()
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError) as err:
        cause = " ".join(str(err).split())[:400] or type(err).__name__
        raise ModelFolderError(f"model folder `{folder}`: cannot load `{part}` ({type(err).__name__}: {cause}). "
                               "The folder is incomplete or a file in it is damaged: copy that part again from "
                               "the original checkpoint (or point model.path at a complete folder)") from err
    return check_loaded(folder, part, loaded)


def check_loaded(folder, part: str, loaded):
    """What from_pretrained accepted can still be unusable: weights holding NaN or inf (every
    sample then decodes to the same image, every reward is equal, and a run trains on nothing), or a
    tokenizer whose vocabulary file is missing (every word becomes the unknown token). Returns
    `loaded` when it is sound."""
    from pixelrl.core.errors import ModelFolderError

    if isinstance(loaded, nn.Module):
        for name, tensor in [*loaded.named_parameters(), *loaded.named_buffers()]:
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ModelFolderError(f"model folder `{folder}`: `{part}` holds NaN or inf weights (first in `{name}`):"
                                       " the checkpoint is damaged; copy it again from the original")
    elif hasattr(loaded, "all_special_ids") and len(loaded) <= len(set(loaded.all_special_ids)):
        raise ModelFolderError(f"model folder `{folder}`: `{part}` has no vocabulary ({len(loaded)} tokens, all "
                               "special): its tokenizer.json / vocab files are missing; copy them again from the "
                               "original checkpoint")
    return loaded
