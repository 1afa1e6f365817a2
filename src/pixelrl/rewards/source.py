"""Rewards of an edit that read its source image (the row's condition image).

A reward function that reads the sources sets `reads_condition_images = True`; `WeightedReward`
then calls it with `condition_images=` (row i's tuple of uint8 [H, W, 3] sources, at the edited
image's size), and refuses a batch without sources by the reward's name.
"""

from __future__ import annotations

import torch

from pixelrl.rewards.registry import check_number_option, register_reward


@register_reward("source_preservation")
def source_preservation(scale: float = 1.0):
    """Pixel-level preservation of the source (the option for masks and exact edits beside a
    semantic similarity): 1 - mean |edited - source| / 255 over every pixel of the first source,
    times `scale`; 1 for an untouched source, 0 for its opposite."""

    def reward(images, prompts, metadata, condition_images=None):
        sources = torch.stack([row[0] for row in condition_images]).to(torch.float32)
        if sources.shape != images.shape:
            raise ValueError(f"sources {tuple(sources.shape)} and edited images {tuple(images.shape)} differ in size")
        difference = (images.to(torch.float32) - sources).abs().mean(dim=(1, 2, 3)) / 255.0
        return {"source_preservation": (1.0 - difference) * scale}

    reward.reads_condition_images = True
    return reward


def _check_scale(options: dict, field: str) -> None:
    check_number_option(options, field, "scale", 1.0, lambda v: v != 0 and abs(v) < float("inf"),
                        "a finite non-zero number")


source_preservation.check_options = _check_scale
# the config check refuses it for a text-to-image family (no sources) before any worker starts
source_preservation.reads_condition_images = True
