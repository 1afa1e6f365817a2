"""FLUX.1 family adapter (`FluxPipeline`) over diffusers components.

What sets FLUX apart from SD3, all handled here so the rollout loop and the losses stay the same:
- guidance-distilled: FLUX.1-dev takes the guidance scale as an embedding input of the denoiser
  (`guidance_embeds`), so there is no CFG batch and no negative prompt (schnell has neither);
- packed latents: the transformer sees 2 x 2 latent patches as tokens with 3-axis rotary ids
  (`img_ids`, `txt_ids`). pixelrl keeps latents unpacked `[B, C, h, w]` everywhere (noise, SDE
  steps, log-probs per element are unchanged by a permutation) and packs them around each forward;
- the sigma grid is linspace(1, 1/N, N) shifted by `mu` from the image's token count (dynamic
  shifting), as `FluxPipeline` sets it;
- prompts: CLIP pooled output + T5 token states, through the pipeline's own `encode_prompt`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.models.base import (JOINT_ATTENTION_LORA_TARGETS, PromptEmbeds, load_part, vae_decode, vae_encode,
                                 vae_scale_factor)
from pixelrl.models.packed import PackedLatentsModel

# Flow-GRPO's FLUX targets: the attention projections (double-stream blocks, image and text; the
# single-stream blocks' to_q/k/v match too) and both feed-forwards of the double-stream blocks.
FLUX_LORA_TARGETS = (*JOINT_ATTENTION_LORA_TARGETS, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                     "ff_context.net.2")


class FluxModel(PackedLatentsModel):
    default_lora_targets = FLUX_LORA_TARGETS
    pipeline_class_name = "FluxPipeline"
    uses_negative_prompt = False  # guidance is an input of the denoiser, not a second branch

    text_tokens_hint = ("FLUX's text conditioning is the T5 token states: use 512 (FLUX.1-dev) or 256 (schnell); "
                        "tiny models fewer")

    @classmethod
    def latent_unit(cls, folder: Path) -> int | None:
        if not (folder / "vae" / "config.json").is_file():
            return None
        return 2 * vae_scale_factor(folder)  # a VAE cell, then 2 x 2 cells per token

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_sequence_length: int = 512, num_frames: int = 1, prompt_cache_size: int = 4096):
        super().__init__(prompt_cache_size)
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

        folder = self._open(path, ("transformer", "scheduler", "vae", "text_encoder", "text_encoder_2"), device, dtype,
                            max_sequence_length, num_frames)
        self.transformer = self._load_module(folder, "transformer", FluxTransformer2DModel, frozen=False)
        self.scheduler = self._load_scheduler(folder)
        self.vae = self._load_module(folder, "vae", AutoencoderKL)
        clip = self._load_module(folder, "text_encoder", CLIPTextModel)
        t5 = self._load_module(folder, "text_encoder_2", T5EncoderModel)
        clip_tok = load_part(folder, "tokenizer/", lambda: CLIPTokenizer.from_pretrained(folder / "tokenizer"))
        t5_tok = load_part(folder, "tokenizer_2/", lambda: AutoTokenizer.from_pretrained(folder / "tokenizer_2"))
        # The diffusers pipeline over the same modules: its encode_prompt and (un)packing helpers.
        self.pipeline = self.pipeline_class()(scheduler=self.scheduler, vae=self.vae, text_encoder=clip,
                                              tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok,
                                              transformer=self.transformer)
        self.vae_scale = self.pipeline.vae_scale_factor
        self.latent_channels = self.transformer.config.in_channels // 4
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)

    # --- text -----------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> PromptEmbeds:
        """diffusers' `encode_prompt`: T5 token states [B, L, D] and the CLIP pooled vector."""
        embeds, pooled, _ = self.pipeline.encode_prompt(prompts, prompts, device=self.device,
                                                        max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.to(self.dtype), pooled.to(self.dtype))

    # --- denoiser -------------------------------------------------------------------------
    def predict_velocity(self, latents, sigmas, text: PromptEmbeds, *, guidance_scale: float = 1.0,
                         negative: PromptEmbeds | None = None) -> torch.Tensor:
        """One forward; the guidance scale enters as the denoiser's guidance embedding."""
        x = latents.to(self.dtype)
        sig = sigmas.to(device=latents.device, dtype=torch.float32).expand(latents.shape[0])
        guidance = (torch.full_like(sig, float(guidance_scale)) if self.guidance_embeds else None)
        with self.compute_precision():
            return self._forward(x, sig, text, guidance).float()

    def _forward(self, latents, sigmas, text: PromptEmbeds, guidance=None):
        batch, channels, h, w = latents.shape
        packed = self.pipeline._pack_latents(latents, batch, channels, h, w)
        image_ids = self.pipeline._prepare_latent_image_ids(batch, h // 2, w // 2, self.device, self.dtype)
        target_tokens = packed.shape[1]
        if text.condition_latents is not None:  # FLUX.1 Kontext (models/flux_kontext)
            packed, image_ids = self._append_condition(packed, image_ids, text.condition_latents)
        text_ids = torch.zeros(text.embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = self.transformer(
            hidden_states=packed,
            # FLUX's transformer takes the timestep in [0, 1] (it multiplies by 1000 itself)
            timestep=sigmas.float(),
            guidance=guidance,
            pooled_projections=text.pooled.to(self.device, self.dtype),
            encoder_hidden_states=text.embeds.to(self.device, self.dtype),
            txt_ids=text_ids, img_ids=image_ids, return_dict=False,
        )[0][:, :target_tokens]  # the condition's tokens are context, not prediction
        return self.pipeline._unpack_latents(out, h * self.vae_scale, w * self.vae_scale, self.vae_scale)

    # --- images ---------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.vae, latents, self.dtype)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.latent_shape(images.shape[1], images.shape[2])  # names a size the model cannot take
        return vae_encode(self.vae, images, self.device, self.dtype)
