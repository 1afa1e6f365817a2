"""Advantage estimators for the GRPO family (pure tensor functions)."""

from __future__ import annotations

from typing import Sequence

import torch

from pixelrl.core.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "algorithm.adv_estimator")


def group_index(group_ids) -> torch.Tensor:
    """Map arbitrary group labels (uids, ints) to dense ints 0..G-1, in order of appearance."""
    if isinstance(group_ids, torch.Tensor):
        labels = group_ids.tolist()
    else:
        labels = list(group_ids)
    dense: dict = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in labels], dtype=torch.long)


def group_moments(r: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rewards `r` in the dense groups `idx` (`group_index`): each group's count, r centred on
    its group's mean, and each group's sum of squared deviations."""
    num_groups = int(idx.max()) + 1 if idx.numel() else 0
    counts = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
    means = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, idx, r) / counts
    centred = r - means[idx]
    return counts, centred, torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, idx, centred ** 2)


def group_advantages(
    rewards: torch.Tensor,
    group_ids,
    *,
    norm_by_std: bool = True,
    global_std: bool = True,
    eps: float = 1e-4,
    unbiased: bool = False,
) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / (std + eps).

    std is the std of the whole batch (`global_std`) or of i's group; the population std
    (ddof 0, Flow-GRPO) by default, the sample std (ddof 1) with `unbiased` (DanceGRPO and
    MixGRPO: per group, eps 1e-8). `norm_by_std=False` is Dr.GRPO (no division). A sample
    alone in its group gets exactly 0.
    """
    r = rewards.detach().to(torch.float64).reshape(-1)
    idx = group_index(group_ids).to(r.device)
    if idx.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {idx.numel()} group ids")
    counts, centred, sq = group_moments(r, idx)
    if norm_by_std:
        if global_std:
            std = r.std(unbiased=unbiased) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        else:
            dof = (counts - 1).clamp(min=1) if unbiased else counts
            std = (sq / dof).sqrt()[idx]
        centred = centred / (std + eps)
    centred = torch.where(counts[idx] > 1, centred, torch.zeros_like(centred))
    return centred.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def gdpo_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids,
                    floor: float = 1e-6) -> torch.Tensor:
    """GDPO (Flow-Factory's `advantage_aggregation: gdpo`): each reward normalised within its
    group, (r - mean_g) / max(std_g, floor) with the population std, weighted and summed; the sum
    normalised over the whole batch the same way. Normalising each reward before the sum keeps one
    high-variance reward from drowning the others; with one reward it is the per-group advantage,
    standardised over the batch."""
    idx = group_index(group_ids)
    total = torch.zeros(idx.numel(), dtype=torch.float64)
    for name, values in rewards.items():
        counts, centred, sq = group_moments(values.detach().to(torch.float64).reshape(-1).cpu(), idx)
        total += weights[name] * centred / (sq / counts).sqrt().clamp(min=floor)[idx]
    std = total.std(unbiased=False).clamp(min=floor) if total.numel() else torch.ones((), dtype=torch.float64)
    return ((total - total.mean()) / std).float()


def group_reward_stats(rewards: torch.Tensor, group_ids) -> dict[str, float]:
    """Diagnostics: fraction of groups whose rewards are all equal, mean group std, group size."""
    r = rewards.detach().to(torch.float64).reshape(-1)
    idx = group_index(group_ids)
    num_groups = int(idx.max()) + 1
    stds, sizes = [], []
    for g in range(num_groups):
        member = r[idx == g]
        sizes.append(member.numel())
        stds.append(float(member.std(unbiased=False)) if member.numel() > 1 else 0.0)
    return {
        "zero_std_ratio": sum(s == 0.0 for s in stds) / num_groups,
        "std_mean": sum(stds) / num_groups,
        "group_size": sum(sizes) / num_groups,
    }


@ADVANTAGE_ESTIMATORS.register("grpo", "flow_grpo")
def grpo_estimator(rewards: torch.Tensor, group_ids: Sequence, *, norm_by_std: bool = True,
                   global_std: bool = True, eps: float = 1e-4, unbiased: bool = False) -> torch.Tensor:
    return group_advantages(rewards, group_ids, norm_by_std=norm_by_std, global_std=global_std, eps=eps,
                            unbiased=unbiased)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_estimator(rewards: torch.Tensor, group_ids: Sequence, *, global_std: bool = True,
                      eps: float = 1e-4, **_ignored) -> torch.Tensor:
    """Dr.GRPO: group-centred rewards without the std division."""
    return group_advantages(rewards, group_ids, norm_by_std=False, global_std=global_std, eps=eps)


# Estimators that compare samples of the same prompt: they need rollout.n > 1.
grpo_estimator.needs_groups = True
dr_grpo_estimator.needs_groups = True


def zero_advantage_keep(advantages: torch.Tensor, multiple: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the samples to train when zero-advantage samples are dropped (Flow-GRPO).

    Every sample whose advantage is exactly 0 is dropped, then randomly chosen dropped ones are
    added back until the count is a multiple of `multiple` (mini-batches x workers), at least
    `multiple`. The batch size must itself be a multiple. Returns sorted indices.
    """
    adv = advantages.reshape(-1)
    if adv.numel() % multiple:
        raise ValueError(f"a batch of {adv.numel()} samples is not a multiple of {multiple}")
    nonzero = (adv != 0).nonzero().flatten()
    zero = (adv == 0).nonzero().flatten()
    missing = max(multiple - nonzero.numel(), (-nonzero.numel()) % multiple)
    back = zero[torch.randperm(zero.numel(), generator=generator)[:missing]]
    return torch.cat([nonzero, back]).sort().values


def get_advantage_estimator(name: str):
    return ADVANTAGE_ESTIMATORS.get(name)
