"""Seeding helpers. Sampling noise comes from per-sample generators so that a sample's image
depends only on its own seed, not on which worker or mini-batch it lands in."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def sample_generators(seeds, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One torch.Generator per sample, seeded with that sample's seed."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def randn_per_sample(shape_per_sample, generators: list[torch.Generator], device, dtype=torch.float32) -> torch.Tensor:
    """Stack of standard-normal draws, the i-th from the i-th generator (advancing it)."""
    return torch.stack(
        [torch.randn(tuple(shape_per_sample), generator=g, device=device, dtype=dtype) for g in generators]
    )
