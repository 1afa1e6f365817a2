"""Group-wise rewards: a score per image computed from comparisons within its prompt's group.

A reward factory marked `groupwise = True` is always called with whole groups (every image of a
row in one call; the reward workers route the full batch to one worker for it), so it can compare
the images of a group with each other. Its function is called with `groups=`: each image's group
key, the row's uid in training (the key the advantages group by, so two rows with one prompt,
such as two edits of different sources under one instruction, stay apart), or None where the
images have no rows (validation, a direct call), when images group by their prompt. Its output is
still one score per image, and the group advantage code takes it unchanged.

`pairwise_win_rate` turns any per-image reward into the win rate of pairwise comparisons:

    win_i = ( Σ_{j in G(i), j != i} [s_i > s_j] + ½ [s_i = s_j] ) / (|G(i)| - 1)     (½ alone)

G(i) = the images of i's group (its row's; without groups, its prompt's). Win rates are invariant
to any increasing transform of the inner score, so a reward whose scale drifts or is badly
calibrated gives stable advantages.
"""

from __future__ import annotations

import torch

from pixelrl.rewards.registry import REWARDS, check_inner_reward, get_reward, register_reward


def group_index(prompts: list[str], groups: list | None = None) -> torch.Tensor:
    """A group id per image, in order of first appearance: images with the same group key share
    one (`groups`, the rows' uids), or without keys those with the same prompt."""
    ids: dict = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in (prompts if groups is None else groups)],
                        dtype=torch.long)


def win_rates(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Fraction of the other images of its group each image beats (ties count half)."""
    same = groups[:, None] == groups[None, :]
    beats = (scores[:, None] > scores[None, :]).float() + 0.5 * (scores[:, None] == scores[None, :]).float()
    others = same.float() - torch.eye(len(scores))
    n_others = others.sum(1)
    wins = (beats * others).sum(1)
    return torch.where(n_others > 0, wins / n_others.clamp(min=1), torch.full_like(wins, 0.5))


def check_win_rate_options(options: dict, field: str) -> None:
    per_image = [n for n in REWARDS.names() if not getattr(REWARDS.get(n), "groupwise", False)]
    check_inner_reward(options, field, "", per_image, "the per-image reward to compare")


@register_reward("pairwise_win_rate")
def pairwise_win_rate(reward: str = "", reward_options: dict | None = None, key: str | None = None):
    """Win rate within the image's group of `reward` (built with `reward_options`); `key` picks its
    output when it returns several (default: the output named like it, or its only one)."""
    check_win_rate_options({"reward": reward, "reward_options": reward_options}, "reward.functions[].options")
    inner = get_reward(reward, **dict(reward_options or {}))

    def score(images, prompts, metadata, groups=None):
        out = inner(images, prompts, metadata)
        main = key or (reward if reward in out else next(iter(out)))
        return {"pairwise_win_rate": win_rates(out[main].float(), group_index(prompts, groups)),
                f"pairwise_win_rate/{reward}": out[main].float()}

    return score


pairwise_win_rate.check_options = check_win_rate_options
pairwise_win_rate.groupwise = True


def is_groupwise(functions: list[dict]) -> bool:
    """True when any configured reward must see whole groups."""
    return any(getattr(REWARDS.get(f["name"]), "groupwise", False) for f in functions)
