"""Reward registry and the checks every reward output goes through.

A reward is `fn(images_uint8 [B, H, W, 3], prompts, metadata) -> dict[str, Tensor[B]]`.
Rewards with options are registered as factories: `get_reward(name, **options)` returns the
configured function.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from pixelrl.core.errors import RewardError
from pixelrl.core.registry import Registry

RewardFn = Callable[[torch.Tensor, list, list], dict]
REWARDS: Registry = Registry("reward", "reward.functions[].name")


def register_reward(name: str, *aliases: str):
    """Register a reward factory: a callable taking options and returning a reward function."""
    return REWARDS.register(name, *aliases)


def check_reward_options(name: str, options: dict, field: str = "reward.functions[].options") -> None:
    """Stop with a ConfigError naming `field` if `options` holds a key the reward does not take."""
    from pixelrl.core.errors import ConfigError

    params = inspect.signature(REWARDS.get(name)).parameters
    unknown = [k for k in options if k not in params]
    if unknown:
        raise ConfigError(field, dict(options), f"reward `{name}` has no option(s) {unknown}; known: {sorted(params)}")
    # a factory may check its option values too (cheaply: no model is loaded before workers start)
    check_values = getattr(REWARDS.get(name), "check_options", None)
    if check_values is not None:
        check_values(options, field)


def get_reward(name: str, **options) -> RewardFn:
    factory = REWARDS.get(name)
    check_reward_options(name, options)
    fn = factory(**options)
    fn.reward_name = name
    return fn


# |score| above this is a bug in the reward, not a signal: its square overflows float32 sums
REWARD_MAGNITUDE_LIMIT = 1e15


def check_reward_output(name: str, output, batch_size: int) -> dict[str, torch.Tensor]:
    """Stop with an error naming the reward unless it returned finite float tensors of shape [B]."""
    if not isinstance(output, dict) or not output:
        raise RewardError(
            f"reward `{name}` returned {type(output).__name__}; it must return a non-empty "
            f"dict[str, torch.Tensor] of shape [{batch_size}]"
        )
    checked = {}
    for key, value in output.items():
        if not isinstance(value, torch.Tensor):
            raise RewardError(
                f"reward `{name}` returned a {type(value).__name__} for `{key}`; return a torch.Tensor of "
                f"shape [{batch_size}] (wrap it with torch.as_tensor)"
            )
        if tuple(value.shape) != (batch_size,):
            raise RewardError(
                f"reward `{name}` returned shape {tuple(value.shape)} for `{key}`; expected [{batch_size}], "
                f"one score per image"
            )
        value = value.detach().float().cpu()
        bad = (~torch.isfinite(value)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(
                f"reward `{name}` returned non-finite values for `{key}` at batch positions {bad[:8]}; "
                f"fix the reward so that every image gets a finite score"
            )
        if value.abs().max() > REWARD_MAGNITUDE_LIMIT:
            raise RewardError(
                f"reward `{name}` returned {value.abs().max().item():.3g} for `{key}`: scores beyond "
                f"{REWARD_MAGNITUDE_LIMIT:.0e} overflow float32 group statistics (the std squares them); "
                "rescale the reward (or give it a small weight inside the reward function)"
            )
        checked[key] = value
    return checked
