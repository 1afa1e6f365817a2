"""Rewards of an edit that read its source image (the row's condition image).

A reward function that reads the sources sets `reads_condition_images = True`; `WeightedReward`
then calls it with `condition_images=` (row i's tuple of uint8 [H, W, 3] sources, at the run's
`rollout.condition_resolution`, the edited image's size unless set), and refuses a batch without
sources by the reward's name.
"""

from __future__ import annotations

import torch

from pixelrl.rewards.registry import (check_model_folder_option, check_number_option, loaded_on_first_call,
                                      register_reward)


def first_sources(condition_images, size: tuple[int, int]) -> torch.Tensor:
    """Each row's first source as uint8 [B, H, W, 3] at `size`, when the run decodes sources at
    another size than it generates (`rollout.condition_resolution`), or rows sent to a reward
    server carry sources of several sizes: each resized on its own, area averages to shrink (each
    output pixel the mean of the source pixels it covers), bilinear to enlarge."""
    return torch.stack([_at_size(row[0], tuple(size)) for row in condition_images])


def _at_size(source: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(source.shape[:2]) == size:
        return source
    shrink = source.shape[0] >= size[0] and source.shape[1] >= size[1]
    resized = torch.nn.functional.interpolate(source.permute(2, 0, 1)[None].float(), size=size,
                                              mode="area" if shrink else "bilinear",
                                              **({} if shrink else {"align_corners": False}))
    return resized[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)


@register_reward("source_preservation")
def source_preservation(scale: float = 1.0):
    """Pixel-level preservation of the source (the option for masks and exact edits beside a
    semantic similarity): 1 - mean |edited - source| / 255 over every pixel of the first source,
    times `scale`; 1 for an untouched source, 0 for its opposite."""

    def reward(images, prompts, metadata, condition_images=None):
        sources = first_sources(condition_images, tuple(images.shape[1:3])).to(torch.float32)
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


@register_reward("clip_source_similarity")
def clip_source_similarity(path: str = "", batch_size: int = 32, processor_path: str | None = None):
    """Semantic preservation of the source: the cosine of the CLIP image embeddings of the edit and
    of its first source (a local CLIP folder, as `clip_score`'s); 1 for the same picture. Paired
    with an instruction-following reward it keeps an edit from redrawing the whole scene."""
    from pixelrl.rewards.clip import ClipBackbone

    check_model_folder_option({"path": path}, "reward.functions[].options")

    def score(clip, images, prompts, condition_images):
        sources = first_sources(condition_images, tuple(images.shape[1:3]))
        return {"clip_source_similarity": (clip.image_embeds(images) * clip.image_embeds(sources)).sum(-1).cpu()}

    reward = loaded_on_first_call(lambda: ClipBackbone(path, batch_size, processor_path), score)
    reward.reads_condition_images = True
    return reward


clip_source_similarity.check_options = check_model_folder_option
clip_source_similarity.reads_condition_images = True
