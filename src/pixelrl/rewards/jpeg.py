"""JPEG (in)compressibility (DDPO): the size in kB of the image saved as JPEG at quality 95."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from pixelrl.rewards.registry import check_number_option, register_reward


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


def _check_jpeg(options: dict, field: str) -> None:
    """Checked before any worker starts (the values would otherwise fail, or score nonsense, at
    the first step): a finite non-zero scale and a JPEG quality PIL takes."""
    check_number_option(options, field, "scale", 1.0, lambda v: v != 0 and abs(v) < float("inf"),
                        "a finite non-zero number (Flow-GRPO uses 1/500)")
    check_number_option(options, field, "quality", 95, lambda v: 1 <= v <= 100,
                        "an integer in [1, 100] (PIL's JPEG quality; DDPO uses 95)", integer=True)


jpeg_compressibility.check_options = _check_jpeg
jpeg_incompressibility.check_options = _check_jpeg
