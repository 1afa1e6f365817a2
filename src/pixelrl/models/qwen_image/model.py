"""Qwen-Image family adapter (`QwenImagePipeline`) over diffusers components.

What sets Qwen-Image apart, all handled here:
- the text conditioning is the last hidden state of a Qwen2.5-VL language model run on a chat
  template, with the template's system-prompt tokens dropped: sequences differ in length, so a
  batch carries an attention mask (`PromptEmbeds.mask`);
- true classifier-free guidance with norm rescaling: v = v_u + s (v_c - v_u), then rescaled per
  token to the norm of v_c (on the packed 2 x 2 patch tokens, as the pipeline does);
- packed latents over a video-style VAE (`AutoencoderKLQwenImage`, one frame, per-channel latent
  mean and std); pixelrl keeps latents unpacked `[B, C, h, w]` and packs around each forward;
- the sigma grid linspace(1, 1/N, N) shifted by `mu` from the image's token count.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.models.base import (JOINT_ATTENTION_LORA_TARGETS, PromptEmbeds, from_uint8_images, load_part,
                                 read_component_config, to_uint8_images)
from pixelrl.models.packed import PackedLatentsModel

class QwenImageModel(PackedLatentsModel):
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    pipeline_class_name = "QwenImagePipeline"
    diffusers_guidance_argument = "true_cfg_scale"  # its guidance_scale is for guidance-distilled checkpoints
    required_parts = ("transformer", "scheduler", "vae", "text_encoder")
    text_tokens_hint = ("Qwen-Image is conditioned on the text encoder's token states: use at most 1024 (the "
                        "pipeline's limit), e.g. 512")

    @classmethod
    def latent_unit(cls, folder: Path) -> int | None:
        vae = read_component_config(folder, "vae")
        if vae is None:
            return None
        return 2 * 2 ** len(vae.get("temperal_downsample", [False, True, True]))

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_sequence_length: int = 512, num_frames: int = 1, prompt_cache_size: int = 4096):
        super().__init__(prompt_cache_size)
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        folder = self._open(path, self.required_parts, device, dtype, max_sequence_length, num_frames)
        self.transformer = self._load_module(folder, "transformer", QwenImageTransformer2DModel, frozen=False)
        self.scheduler = self._load_scheduler(folder)
        self.vae = self._load_module(folder, "vae", AutoencoderKLQwenImage)
        encoder = self._load_module(folder, "text_encoder", Qwen2_5_VLForConditionalGeneration)
        tokenizer = load_part(folder, "tokenizer/", lambda: AutoTokenizer.from_pretrained(folder / "tokenizer"))
        # The diffusers pipeline over the same modules: its encode_prompt and (un)packing helpers.
        self.pipeline = self._pipeline(folder, dict(scheduler=self.scheduler, vae=self.vae, text_encoder=encoder,
                                                    tokenizer=tokenizer, transformer=self.transformer))
        self.vae_scale = self.pipeline.vae_scale_factor
        self.latent_channels = self.transformer.config.in_channels // 4
        z_dim = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1).to(self.device)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1).to(self.device)

    def _pipeline(self, folder: Path, components: dict):
        return self.pipeline_class()(**components)

    # --- text -----------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> PromptEmbeds:
        """diffusers' `encode_prompt`: token states after the template, and their mask."""
        embeds, mask = self.pipeline.encode_prompt(prompts, device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeds(embeds.to(self.dtype), mask=mask)

    # --- denoiser -------------------------------------------------------------------------
    def predict_velocity(self, latents, sigmas, text: PromptEmbeds, *, guidance_scale: float = 1.0,
                         negative: PromptEmbeds | None = None) -> torch.Tensor:
        """True CFG with norm rescaling, both branches in one batched forward (padded and masked
        to the longer text); the combination is taken per packed token, as in QwenImagePipeline."""
        x = latents.to(self.dtype)
        sig = sigmas.to(device=latents.device, dtype=torch.float32).expand(latents.shape[0])
        if guidance_scale == 1.0 or negative is None:
            return self._unpack(self._packed_forward(x, sig, text).float(), x.shape)
        both = PromptEmbeds.cat([negative, text])
        v_uncond, v_cond = self._packed_forward(torch.cat([x, x]), torch.cat([sig, sig]), both).float().chunk(2)
        combined = v_uncond + guidance_scale * (v_cond - v_uncond)
        combined = combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return self._unpack(combined, x.shape)

    def _forward(self, latents, sigmas, text: PromptEmbeds):
        return self._unpack(self._packed_forward(latents, sigmas, text), latents.shape)

    def _packed_forward(self, latents, sigmas, text: PromptEmbeds):
        """The transformer on the packed target tokens, followed (Qwen-Image-Edit) by each condition
        image's packed latents, `img_shapes` naming every image's token grid for the 2-D RoPE; the
        prediction is the target's tokens only."""
        batch, channels, h, w = latents.shape
        tokens, shapes = [self.pipeline._pack_latents(latents, batch, channels, h, w)], [(1, h // 2, w // 2)]
        if text.condition_latents is not None:
            for k in range(text.condition_latents.shape[1]):
                cond = text.condition_latents[:, k].to(self.device, self.dtype)
                _, _, ch, cw = cond.shape
                tokens.append(self.pipeline._pack_latents(cond, batch, channels, ch, cw))
                shapes.append((1, ch // 2, cw // 2))
        return self.transformer(
            hidden_states=torch.cat(tokens, dim=1),
            timestep=sigmas.float(),  # in [0, 1]: the transformer scales it itself
            encoder_hidden_states=text.embeds.to(self.device, self.dtype),
            encoder_hidden_states_mask=text.mask.to(self.device),
            img_shapes=[shapes] * batch,
            return_dict=False,
        )[0][:, :tokens[0].shape[1]]

    def _unpack(self, packed, shape):
        _, _, h, w = shape
        return self.pipeline._unpack_latents(packed, h * self.vae_scale, w * self.vae_scale,
                                             self.vae_scale).squeeze(2)

    # --- images ---------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.device) * self.latents_std + self.latents_mean
        frames = self.vae.decode(z.to(self.dtype)[:, :, None], return_dict=False)[0]  # one-frame video
        return to_uint8_images(frames[:, :, 0])

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """The VAE posterior mean, normalised with the VAE's per-channel latent mean and std."""
        self.latent_shape(images.shape[1], images.shape[2])
        pixels = from_uint8_images(images).to(self.device, self.dtype)[:, :, None]
        z = self.vae.encode(pixels).latent_dist.mode()[:, :, 0].float()
        return (z - self.latents_mean) / self.latents_std
