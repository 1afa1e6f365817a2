"""Seeding helpers. Sampling noise comes from per-sample generators so that a sample's image
depends only on its own seed, not on which worker or mini-batch it lands in.

Different random decisions of one step (the SDE window, the trained timesteps, a group's shared
initial noise) each get their own stream: `derive_seed(seed, "window")` and
`derive_seed(seed, "trained_steps")` are unrelated seeds, so no draw of one decision is a
replay of another's.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def derive_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for the named `stream` of `seed` (numpy SeedSequence mixing: distinct
    streams and distinct seeds give statistically independent generators)."""
    state = np.random.SeedSequence([int(seed) % (2**63), zlib.crc32(stream.encode())]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def sample_generators(seeds, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One torch.Generator per sample, seeded with that sample's seed."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
