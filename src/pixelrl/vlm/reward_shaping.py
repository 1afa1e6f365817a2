"""What happens to a vision-language step's rewards between the scorers and the advantages:
DAPO's overlong penalty, its filter of groups that cannot teach (dynamic sampling), and
LightRFT's running reward normalisation and clipping. Pure tensor math; the engine applies them
(`VLMEngine.make_experience`)."""

from __future__ import annotations

import math
from typing import Callable

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to `max_new_tokens - buffer` response tokens, then
    falling linearly to `-factor` at `max_new_tokens` (min(-(L - (L_max - buffer)) / buffer x
    factor, 0), as verl's DAPO reward manager and LightRFT write it)."""
    expected = max_new_tokens - buffer
    return torch.clamp(-(lengths.double() - expected) / buffer * factor, max=0.0).to(torch.float32)


def informative_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Per group of `n` consecutive samples: whether its rewards differ (DAPO keeps only those:
    a group whose samples all score alike has zero group-relative advantage and teaches nothing)."""
    grouped = rewards.view(-1, n)
    return grouped.amax(1) != grouped.amin(1)


def group_rows(groups: torch.Tensor, n: int) -> torch.Tensor:
    """The rows of these groups of `n` consecutive samples, group by group."""
    return (groups.view(-1, 1) * n + torch.arange(n)).flatten()


class RunningMoments:
    """The running mean and (unbiased) standard deviation of every reward seen, combined batch
    by batch with the parallel-variance rule, starting from LightRFT's (mean 0, var 1, count 1e-24).
    `all_reduce` sums a batch's (count, sum, sum of squares) over data-parallel ranks first, so
    every rank holds the same moments (LightRFT keeps one per rank)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0

    def update(self, values: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        values = values.double().flatten()
        totals = torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64), values.sum(),
                              (values ** 2).sum()])
        if all_reduce is not None:
            totals = all_reduce(totals)
        count, total, squares = totals.tolist()
        if count == 0:
            return
        batch_mean = total / count
        batch_var = max(squares / count - batch_mean ** 2, 0.0)  # population variance of the batch
        delta = batch_mean - self.mean
        combined = self.count + count
        self.var = (self.var * self.count + batch_var * count + delta ** 2 * self.count * count / combined) / combined
        self.mean += delta * count / combined
        self.count = combined

    def normalize(self, values: torch.Tensor, subtract_mean: bool) -> torch.Tensor:
        return ((values - self.mean) if subtract_mean else values) / self.std

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])
