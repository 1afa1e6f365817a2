"""Which denoising steps are stochastic (SDE) and trained.

A window is a contiguous range [start, end) of step indices, shared by the whole rollout
batch. Steps inside use the SDE with noise level a; steps outside use a = 0 (deterministic
Euler), so only window steps carry randomness, store latents and get trained. The last step
(into sigma = 0) is never in a window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pixelrl.core.errors import ConfigError, require_integer


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


@dataclass(frozen=True)
class RandomWindowParams:
    """`random` (Flow-GRPO-Fast): no params; the start is drawn from the step's rollout seed."""


@dataclass(frozen=True)
class MixGRPORandomParams:
    """`mixgrpo_random`: one start per step for every sample, drawn with `seed + global_step`."""
    seed: int = 0

    def __post_init__(self):
        require_integer("rollout.sde_window_params.seed", self.seed, 0)


@dataclass(frozen=True)
class MixGRPOProgressiveParams:
    """`mixgrpo_progressive`: the window moves by `stride` steps every `iters_per_group` training
    steps; with `rollback` it starts again from step 0 after the last start."""
    stride: int = 1
    iters_per_group: int = 25
    rollback: bool = False

    def __post_init__(self):
        require_integer("rollout.sde_window_params.stride", self.stride, 1)
        require_integer("rollout.sde_window_params.iters_per_group", self.iters_per_group, 1)
        if not isinstance(self.rollback, bool):
            raise ConfigError("rollout.sde_window_params.rollback", self.rollback, "true or false")


# rollout.sde_window_schedule -> the params dataclass of rollout.sde_window_params
WINDOW_PARAMS = {"random": RandomWindowParams, "mixgrpo_random": MixGRPORandomParams,
                 "mixgrpo_progressive": MixGRPOProgressiveParams}
WINDOW_SCHEDULES = tuple(WINDOW_PARAMS)


def window_params(schedule: str, given: dict | None):
    """The schedule's params from `rollout.sde_window_params`, each checked (unknown keys named)."""
    if schedule not in WINDOW_PARAMS:
        raise ConfigError("rollout.sde_window_schedule", schedule, f"choose one of {list(WINDOW_SCHEDULES)}")
    cls, given = WINDOW_PARAMS[schedule], dict(given or {})
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError("rollout.sde_window_params", given, f"schedule `{schedule}` has no param(s) {unknown}; "
                          f"known: {known}")
    return cls(**given)


def choose_window(num_steps: int, window_size: int, window_range, seed: int, *, schedule: str = "random",
                  global_step: int = 1, params: dict | None = None) -> Window:
    """The configured window: full when `window_size` is 0; else Flow-GRPO-Fast's random window
    (seeded by the step's rollout seed) or a MixGRPO schedule with its `params`."""
    if window_size <= 0:
        return full_window(num_steps)
    bound = window_params(schedule, params)
    if schedule == "random":
        return random_window(num_steps, window_size, window_range, seed)
    return mixgrpo_window(num_steps, window_size, global_step, schedule=schedule[len("mixgrpo_"):],
                          **dataclasses.asdict(bound))


def window_span(num_steps: int, window_size: int, window_range, schedule: str = "random") -> range:
    """Every step that some window of this configuration may hold."""
    if window_size <= 0:
        return range(0, num_steps - 1)
    if schedule == "random":
        return range(*check_window_args(num_steps, window_size, window_range))
    return range(0, num_steps - 2)  # MixGRPO's [0, M)


def mixgrpo_window(num_steps: int, window_size: int, global_step: int, *, schedule: str = "progressive",
                   seed: int = 0, stride: int = 1, iters_per_group: int = 25, rollback: bool = False) -> Window:
    """MixGRPO: one window shared by every sample of a training step, moved by a schedule.

    Indices live in [0, M) with M = N - 2 (MixGRPO stores N - 1 steps and never trains the
    last stored one); the window is [start, min(start + W, M)).
    - `random`: start = randint(0, M - W) from a generator seeded with seed + global_step
      (the reference draws unseeded; seeding makes runs reproducible and resumable).
    - `progressive`: start = stride * k with k = (global_step - 1) // iters_per_group, i.e. the
      window moves by `stride` every `iters_per_group` steps. It shrinks at the tail
      (N = 25, W = 4: ..., [19, 23), [20, 23), [21, 23), [22, 23)); once start would pass M - 1
      it stays at M - 1, or with `rollback` starts again from 0.
    """
    last = num_steps - 2  # M: the exclusive upper bound of trained indices
    if not 1 <= window_size <= last:
        raise ConfigError("rollout.sde_window_size", window_size,
                          f"a MixGRPO window needs 1 <= sde_window_size <= num_steps - 2 = {last}")
    if schedule == "random":
        gen = torch.Generator().manual_seed(int(seed + global_step))
        start = int(torch.randint(0, last - window_size + 1, (1,), generator=gen))
    elif schedule == "progressive":
        moves = (global_step - 1) // max(1, iters_per_group)
        if rollback:
            positions = (last - 1) // stride + 1  # starts 0, stride, ... up to M - 1
            start = (moves % positions) * stride
        else:
            start = min(moves * stride, last - 1)
    else:
        raise ConfigError("rollout.sde_window_schedule", f"mixgrpo_{schedule}",
                          f"choose one of {list(WINDOW_SCHEDULES)}")
    return Window(start, min(start + window_size, last))


def trained_step_indices(window_size: int, batch_size: int, *, num_steps: int, fraction: float = 1.0,
                         permute: bool = False, seed: int = 0) -> torch.Tensor:
    """[B, K] indices into the window of the steps each sample trains on.

    In order (Flow-GRPO `timestep_fraction`): the first K = min(W, int(num_steps * fraction))
    steps for every sample. Permuted (DanceGRPO): a random permutation of the W stored steps per
    sample, of which the first K = int(W * fraction) are trained (DanceGRPO stores N - 1 steps:
    int((N - 1) * fraction)); the permutations come from a generator seeded with `seed`.
    At least one step is always trained.
    """
    if not permute:
        k = min(window_size, max(1, int(num_steps * fraction)))
        return torch.arange(k).unsqueeze(0).expand(batch_size, -1).clone()
    k = max(1, int(window_size * fraction))
    gen = torch.Generator().manual_seed(int(seed))
    return torch.stack([torch.randperm(window_size, generator=gen)[:k] for _ in range(batch_size)])
