"""JPEG (in)compressibility (DDPO): the size in kB of the image saved as JPEG at quality 95."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from pixelrl.rewards.registry import register_reward


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    arrays = images.detach().cpu().numpy().astype(np.uint8)
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array, mode="RGB").save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(scale: float = 1.0, quality: int = 95):
    """Reward = -size_kB * scale (DDPO uses scale 1; Flow-GRPO scales by 1/500)."""

    def reward(images, prompts, metadata):
        return {"jpeg_compressibility": -jpeg_sizes_kb(images, quality) * scale}

    return reward


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(scale: float = 1.0, quality: int = 95):
    """Reward = size_kB * scale."""

    def reward(images, prompts, metadata):
        return {"jpeg_incompressibility": jpeg_sizes_kb(images, quality) * scale}

    return reward
