"""What FLUX and Qwen-Image share: latents packed into 2 x 2 patch tokens around each forward,
and their pipelines' sigma grid, linspace(1, 1/N, N) shifted by `mu` from the token count."""

from __future__ import annotations

import torch

from pixelrl.models.base import DiffusionModel, check_resolution, sigmas_from_scheduler


class PackedLatentsModel(DiffusionModel):
    """Latents stay unpacked `[B, C, h, w]` outside the forward (noise, SDE steps and per-element
    log-probs are unchanged by the permutation); a subclass sets `vae_scale` (pixels per latent
    cell) and `latent_channels` when it loads."""

    vae_scale: int
    latent_channels: int
    guidance_token_patch = 2  # the pipelines' 2 x 2 packing: a token is 4 latent cells x C channels

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        check_resolution(height, width, self.vae_scale * 2)  # a VAE cell, then 2 x 2 cells per token
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def image_seq_len(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).tolist()
        return sigmas_from_scheduler(self.scheduler, num_steps, self.image_seq_len(height, width), grid=grid)
