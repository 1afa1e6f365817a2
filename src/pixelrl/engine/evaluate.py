"""Deterministic generation from a model (`pixelrl.trainers.checkpointing.load_for_eval` loads one
from a training checkpoint), and the measures of its images that do not depend on a reward: a
fixed-seed mean reward, the diversity within a prompt."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pixelrl.core.progress import Progress, report_progress
from pixelrl.models.base import DiffusionModel
from pixelrl.sampling.rollout import SamplingSettings, rollout
from pixelrl.sampling.schedule import schedule_sigmas
from pixelrl.sampling.windows import Window


@torch.no_grad()
def generate(model: DiffusionModel, prompts: list[str], seeds: list[int], *, num_steps: int = 10,
             guidance_scale: float = 4.0, resolution: int = 32, negative_prompt: str = "",
             batch_size: int = 128, sigma_schedule: str = "scheduler", sigma_shift: float = 0.0,
             progress: bool = False, condition_images: list | None = None,
             output_size: tuple[int, int] | None = None) -> torch.Tensor:
    """uint8 images [B, H, W, 3] from the ODE sampler (no noise injected), one per (prompt, seed), on
    the grid a run sampled (`rollout.sigma_schedule` / `sigma_shift`: a DMD2 student's shifted grid),
    resolution x resolution px or `output_size` (height, width); an edit family's rows with their
    `condition_images`."""
    height, width = output_size or (resolution, resolution)
    sigmas = schedule_sigmas(model, num_steps, sigma_schedule, height, width, sigma_shift)
    settings = SamplingSettings(noise_level=0.0, guidance_scale=guidance_scale)
    images = []
    counter = Progress(len(prompts)) if progress else None  # `progress`: a line per batch on stderr
    for start in range(0, len(prompts), batch_size):
        out = rollout(model, prompts[start:start + batch_size], seeds[start:start + batch_size], sigmas=sigmas,
                      window=Window(0, 0), settings=settings, height=height, width=width,
                      negative_prompt=negative_prompt,
                      condition_images=None if condition_images is None else condition_images[start:start + batch_size])
        images.append(out.images)
        if counter is not None:
            report_progress("generated images", counter, min(start + batch_size, len(prompts)))
    return torch.cat(images)


@torch.no_grad()
def fixed_seed_reward(engine, reward, prompts: list[str], seeds: list[int]) -> float:
    """Mean overall reward of one image per (prompt, seed), sampled with the engine's own
    rollout settings: a fixed-seed evaluation of its current policy."""
    batch = engine.rollout(prompts, seeds)
    return float(reward(batch["images"], prompts, [{}] * len(prompts))["overall"].mean())


def diversity(images: torch.Tensor, items: list[dict]) -> dict[str, float]:
    """How different the images of one prompt are (different seeds): the mean pairwise L1
    distance between them (0..1), and the fraction of pairs that differ at all (distinct). An
    item's `group`, when it has one, stands for its prompt (an edit's row: one instruction, two
    sources, two groups)."""
    groups: dict = defaultdict(list)
    for i, item in enumerate(items):
        groups[item.get("group", item["prompt"])].append(i)
    distances, distinct = [], []
    x = [image.float() / 255.0 for image in images]  # a tensor's rows, or images of several sizes
    for idx in groups.values():
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                d = float((x[idx[a]] - x[idx[b]]).abs().mean())
                distances.append(d)
                distinct.append(d > 0.01)
    return {"pairwise_l1": float(np.mean(distances)) if distances else 0.0,
            "distinct_pair_fraction": float(np.mean(distinct)) if distinct else 0.0}
