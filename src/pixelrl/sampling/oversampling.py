"""Proxy-ranked oversampling: which samples of a prompt's cheap pool are kept for training.

A step samples `factor x n` candidates per prompt with a cheap deterministic sampler, scores them
with the run's reward, and keeps `n` per prompt by one of these rules; the kept ones are then
sampled again exactly (same seeds, so the same initial noise) with the training sampler. The
rules favour groups with a wide reward spread, which is where a group-normalised advantage
teaches most. Nothing corrects for the selection: the kept set's group mean and std are not the
pool's (best-and-worst inflates the std), and the advantages are computed on the kept set alone,
as the reference implementation does.

Each rule maps one group's proxy rewards [M] and the number to keep K to K distinct positions
in the group (any order; the caller sorts them back into pool order).
"""

from __future__ import annotations

from typing import Callable

import torch

from pixelrl.core.registry import Registry

KEEP_RULES: Registry = Registry("oversampling keep rule", "rollout.oversample.keep")


def _descending(values: torch.Tensor) -> torch.Tensor:
    """Positions from the largest value to the smallest; equal values keep pool order."""
    return torch.sort(values, descending=True, stable=True).indices


@KEEP_RULES.register("best_worst")
def keep_best_worst(proxy: torch.Tensor, keep: int, generator: torch.Generator) -> torch.Tensor:
    """The K // 2 highest and the K - K // 2 lowest proxy rewards (distinct while K <= M)."""
    order = _descending(proxy)
    return torch.cat([order[:keep // 2], order[len(order) - (keep - keep // 2):]])


@KEEP_RULES.register("mean_deviation")
def keep_mean_deviation(proxy: torch.Tensor, keep: int, generator: torch.Generator) -> torch.Tensor:
    """The K proxy rewards farthest from the group's mean, on either side."""
    return _descending((proxy - proxy.mean()).abs())[:keep]


@KEEP_RULES.register("extremes_random")
def keep_extremes_random(proxy: torch.Tensor, keep: int, generator: torch.Generator) -> torch.Tensor:
    """The highest and the lowest proxy reward, the other K - 2 drawn at random from the rest."""
    order = _descending(proxy)
    ends = torch.stack([order[0], order[-1]])[:keep]
    middle = order[1:-1]
    return torch.cat([ends, middle[torch.randperm(len(middle), generator=generator)[:keep - len(ends)]]])


@KEEP_RULES.register("random")
def keep_random(proxy: torch.Tensor, keep: int, generator: torch.Generator) -> torch.Tensor:
    """K drawn at random, whatever the proxy: the control for the ranking rules (the pool then
    only costs time)."""
    return torch.randperm(len(proxy), generator=generator)[:keep]


def kept_positions(proxy: torch.Tensor, uids: list, keep: int, rule: str, generator: torch.Generator) -> list[int]:
    """Positions in the pool (rows of `proxy`, grouped by `uids`) of the samples to keep: `keep`
    per group by `rule`, groups in order of first appearance, each group's in pool order."""
    choose: Callable = KEEP_RULES.get(rule)
    groups: dict = {}
    for position, uid in enumerate(uids):
        groups.setdefault(uid, []).append(position)
    kept: list[int] = []
    for positions in groups.values():
        members = torch.tensor(positions, dtype=torch.long)
        if len(members) < keep:
            raise ValueError(f"a group of {len(members)} candidates cannot keep {keep}")
        chosen = choose(proxy[members].float(), keep, generator)
        if len(set(chosen.tolist())) != keep:
            raise ValueError(f"keep rule `{rule}` chose {chosen.tolist()}, not {keep} distinct candidates")
        kept.extend(sorted(members[chosen].tolist()))
    return kept
