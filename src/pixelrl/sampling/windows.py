"""Which denoising steps are stochastic (SDE) and trained.

A window is a contiguous range [start, end) of step indices, shared by the whole rollout
batch. Steps inside use the SDE with noise level a; steps outside use a = 0 (deterministic
Euler), so only window steps carry randomness, store latents and get trained. The last step
(into sigma = 0) is never in a window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.core.errors import ConfigError


@dataclass(frozen=True)
class Window:
    start: int
    end: int  # exclusive

    @property
    def size(self) -> int:
        return self.end - self.start

    def steps(self) -> list[int]:
        return list(range(self.start, self.end))

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.end


def full_window(num_steps: int) -> Window:
    """Flow-GRPO: SDE on steps 0 .. N-2; the final near-clean step stays ODE."""
    if num_steps < 2:
        raise ConfigError("rollout.num_steps", num_steps, "needs at least 2 denoising steps")
    return Window(0, num_steps - 1)


def check_window_args(num_steps: int, window_size: int, window_range) -> tuple[int, int]:
    r0, r1 = (0, num_steps - 1) if window_range is None else (int(window_range[0]), int(window_range[1]))
    if not 0 <= r0 < r1 <= num_steps - 1:
        raise ConfigError(
            "rollout.sde_window_range", [r0, r1],
            f"needs 0 <= start < end <= num_steps - 1 = {num_steps - 1} (the last step is never stochastic)",
        )
    if not 1 <= window_size <= r1 - r0:
        raise ConfigError(
            "rollout.sde_window_size", window_size, f"must be between 1 and the range length {r1 - r0}"
        )
    return r0, r1


def random_window(num_steps: int, window_size: int, window_range, seed: int) -> Window:
    """Flow-GRPO-Fast: start = randint(r0, r1 - W) inclusive, from a generator seeded by `seed`."""
    r0, r1 = check_window_args(num_steps, window_size, window_range)
    gen = torch.Generator().manual_seed(int(seed))
    start = int(torch.randint(r0, r1 - window_size + 1, (1,), generator=gen))
    return Window(start, start + window_size)


def choose_window(num_steps: int, window_size: int, window_range, seed: int) -> Window:
    """The configured window: full when `window_size` is 0, else the seeded random window."""
    if window_size <= 0:
        return full_window(num_steps)
    return random_window(num_steps, window_size, window_range, seed)
