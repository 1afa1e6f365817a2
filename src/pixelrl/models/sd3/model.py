"""Stable Diffusion 3 / 3.5 family adapter over diffusers components.

Loads any local SD3-layout pipeline folder (transformer, scheduler, optional vae, two CLIP text
encoders, optional T5) and encodes prompts with the diffusers pipeline's own `encode_prompt`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.core.errors import ModelFolderError
from pixelrl.models.base import (JOINT_ATTENTION_LORA_TARGETS, DiffusionModel, PromptEmbeds, check_resolution,
                                 from_uint8_images, load_part, read_component_config, to_uint8_images, vae_decode,
                                 vae_encode, vae_scale_factor)

class SD3Model(DiffusionModel):
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    pipeline_class_name = "StableDiffusion3Pipeline"

    @classmethod
    def load_pipeline(cls, folder: Path):
        """diffusers requires every SD3 component: a folder without T5 (CLIP only) or without a
        VAE (pixel space; sample with output_type="latent") loads with those set to None."""
        kwargs = {}
        if not (folder / "text_encoder_3").is_dir():
            kwargs.update(text_encoder_3=None, tokenizer_3=None)
        if not (folder / "vae").is_dir():
            kwargs.update(vae=None)
        return load_part(folder, "pipeline", lambda: cls.pipeline_class().from_pretrained(
            folder, use_safetensors=True, **kwargs))

    @classmethod
    def latent_unit(cls, folder: Path) -> int | None:
        transformer = read_component_config(folder, "transformer")
        if transformer is None:
            return None
        return int(transformer.get("patch_size", 1)) * vae_scale_factor(folder)

    @classmethod
    def max_side(cls, folder: Path) -> int | None:
        """SD3's position embedding is a learned table of pos_embed_max_size patches a side: a
        larger image has no positions (SD3.5-M: 384 x 2 x 8 = 6144 px; the shapes model: 32)."""
        transformer = read_component_config(folder, "transformer")
        if transformer is None or not transformer.get("pos_embed_max_size"):
            return None
        return int(transformer["pos_embed_max_size"]) * cls.latent_unit(folder)

    def __init__(
        self,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        max_sequence_length: int = 256,
        num_frames: int = 1,
        prompt_cache_size: int = 4096,
    ):
        super().__init__(prompt_cache_size)
        from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        folder = self._open(path, ("transformer", "scheduler"), device, dtype, max_sequence_length, num_frames)
        self.transformer = self._load_module(folder, "transformer", SD3Transformer2DModel, frozen=False)
        self.scheduler = self._load_scheduler(folder)
        self.vae = None
        if (folder / "vae" / "config.json").is_file():
            self.vae = self._load_module(folder, "vae", AutoencoderKL)

        for suffix in ("", "_2"):
            if not (folder / f"text_encoder{suffix}" / "config.json").is_file():
                raise ModelFolderError(f"model folder `{folder}` has no text_encoder{suffix}/: an SD3 pipeline needs "
                                       "both CLIP encoders (text_encoder/, text_encoder_2/ with their tokenizers)")
        clip = [self._load_module(folder, f"text_encoder{suffix}", CLIPTextModelWithProjection) for suffix in ("", "_2")]
        clip_tok = [load_part(folder, f"tokenizer{suffix}/", lambda s=suffix: CLIPTokenizer.from_pretrained(
                    folder / f"tokenizer{s}")) for suffix in ("", "_2")]
        # T5 only when its tokens are used (max_sequence_length 0 = zero T5 tokens, no T5 forward)
        t5 = t5_tok = None
        if (folder / "text_encoder_3" / "config.json").is_file() and self.max_sequence_length > 0:
            from transformers import AutoTokenizer, T5EncoderModel

            t5 = self._load_module(folder, "text_encoder_3", T5EncoderModel)
            t5_tok = load_part(folder, "tokenizer_3/", lambda: AutoTokenizer.from_pretrained(folder / "tokenizer_3"))
        # The diffusers pipeline over the same modules: its encode_prompt is the prompt encoding.
        self.pipeline = StableDiffusion3Pipeline(
            transformer=self.transformer, scheduler=self.scheduler, vae=self.vae,
            text_encoder=clip[0], tokenizer=clip_tok[0], text_encoder_2=clip[1], tokenizer_2=clip_tok[1],
            text_encoder_3=t5, tokenizer_3=t5_tok,
        )
        cfg = self.transformer.config
        self.patch_size = cfg.patch_size
        self.in_channels = cfg.in_channels
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1

    @property
    def clip_encoders(self) -> list:
        return [self.pipeline.text_encoder, self.pipeline.text_encoder_2]

    @property
    def t5_encoder(self):
        return self.pipeline.text_encoder_3

    # --- text -----------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> PromptEmbeds:
        """diffusers' `encode_prompt` (CLIP penultimate states padded to the joint width, then
        T5 tokens, or zeros of max_sequence_length without T5), without guidance."""
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompts, prompts, prompts, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.to(self.dtype), pooled.to(self.dtype))

    # --- denoiser -------------------------------------------------------------------------
    def _forward(self, latents, sigmas, text: PromptEmbeds):
        return self.transformer(
            hidden_states=latents,
            # float32 even for a bf16 model (as diffusers and the references pass it): a bf16
            # timestep is rounded by up to ~2 of 1000.
            timestep=(sigmas.float() * 1000),
            encoder_hidden_states=text.embeds.to(self.device, self.dtype),
            pooled_projections=text.pooled.to(self.device, self.dtype),
            return_dict=False,
        )[0]

    def image_seq_len(self, height: int, width: int) -> int:
        unit = self.vae_scale * self.patch_size
        return (height // unit) * (width // unit)

    # --- images ---------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        check_resolution(height, width, self.vae_scale * self.patch_size)
        return (self.in_channels, height // self.vae_scale, width // self.vae_scale)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:  # pixel-space model: latents are images in [-1, 1]
            return to_uint8_images(latents)
        return vae_decode(self.vae, latents, self.dtype)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.latent_shape(images.shape[1], images.shape[2])  # names a size the model cannot take
        if self.vae is None:
            return from_uint8_images(images).to(self.device)
        return vae_encode(self.vae, images, self.device, self.dtype)
