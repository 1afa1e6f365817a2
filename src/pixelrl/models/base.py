"""The small interface every text-to-image adapter implements.

Sampling and training code only talk to this interface, so SD3.5, FLUX, Qwen-Image and the
shipped tiny model share one rollout loop and one update step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn


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
    """Text conditioning for a batch: sequence embeddings and (for SD3/FLUX) pooled vectors."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor | None = None  # [B, P]

    def __len__(self) -> int:
        return self.embeds.shape[0]

    @staticmethod
    def cat(parts: list["PromptEmbeds"]) -> "PromptEmbeds":
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        return PromptEmbeds(torch.cat([p.embeds for p in parts]), pooled)


class DiffusionModel(ABC):
    """A flow-matching text-to-image model: denoiser, text encoders, scheduler, decoder."""

    transformer: nn.Module  # the denoiser; the only module that is ever trained
    scheduler: object  # a diffusers FlowMatchEulerDiscreteScheduler (or compatible)
    device: torch.device
    dtype: torch.dtype  # compute dtype of the denoiser
    default_lora_targets: tuple[str, ...] = ()

    def __init__(self, prompt_cache_size: int = 4096):
        self._prompt_cache: OrderedDict[str, PromptEmbeds] = OrderedDict()
        self._prompt_cache_size = prompt_cache_size

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
        missing = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        with torch.no_grad():
            for p in missing:
                self._prompt_cache[p] = self._encode_uncached([p])
        parts = []
        for p in prompts:
            self._prompt_cache.move_to_end(p)
            parts.append(self._prompt_cache[p])
        while len(self._prompt_cache) > self._prompt_cache_size:
            self._prompt_cache.popitem(last=False)
        return PromptEmbeds.cat(parts)

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
            return self._forward(x, sig, text).float()
        both = PromptEmbeds.cat([negative, text])
        v = self._forward(torch.cat([x, x]), torch.cat([sig, sig]), both).float()
        v_uncond, v_cond = v.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

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


def to_uint8_images(pixels: torch.Tensor) -> torch.Tensor:
    """[-1, 1] channel-first float images -> uint8 [B, H, W, 3] (rounded, clamped)."""
    x = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu()


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
