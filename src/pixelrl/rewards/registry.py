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


def check_number_option(options: dict, field: str, name: str, default, valid: Callable[[float], bool], fix: str,
                        integer: bool = False) -> None:
    """Stop with a ConfigError naming `field.name` unless the option is a number (an integer when
    `integer`; never a bool or NaN) for which `valid` holds."""
    value = options.get(name, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value != value or not valid(value):
        from pixelrl.core.errors import ConfigError

        raise ConfigError(f"{field}.{name}", value, fix)


def check_inner_reward(options: dict, field: str, default: str, allowed: list[str], role: str) -> None:
    """A reward built around another (`reward` + `reward_options`): the inner name is one of
    `allowed` and its options are its own."""
    inner = options.get("reward", default)
    if inner not in allowed:
        from pixelrl.core.errors import ConfigError

        raise ConfigError(f"{field}.reward", inner, f"{role}, one of {allowed}")
    check_reward_options(inner, dict(options.get("reward_options") or {}), f"{field}.reward_options")


def check_model_folder_option(options: dict, field: str, needs: tuple[str, ...] = ("config.json",)) -> None:
    """The `path` option names a local folder holding `needs`, and `batch_size` is >= 1 (checked
    before any worker starts; a model-based reward loads nothing else)."""
    from pathlib import Path

    from pixelrl.core.errors import ConfigError

    path = options.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{field}.path", path, "the local folder of the scoring model (see docs/rewards/)")
    missing = [name for name in needs if not (Path(path).expanduser() / name).exists()]
    if missing:
        raise ConfigError(f"{field}.path", path, f"this folder lacks {missing}; see docs/rewards/ for the layout "
                                                 "(nothing is downloaded)")
    check_number_option(options, field, "batch_size", 1, lambda v: v >= 1, "an integer >= 1", integer=True)


def loaded_on_first_call(load: Callable[[], object], score: Callable) -> RewardFn:
    """A reward around a model that is loaded where it scores (a reward worker), once, on the
    first call: `score(model, images, prompts)` gives the reward's outputs."""
    model = None

    def reward(images, prompts, metadata, **sources):  # condition_images= for a reward that reads them
        nonlocal model
        if model is None:
            model = load()
        return score(model, images, prompts, **sources)

    return reward


def scoring_device() -> torch.device:
    """Where a model-based reward runs: the reward worker's GPU when it has one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def get_reward(name: str, **options) -> RewardFn:
    factory = REWARDS.get(name)
    check_reward_options(name, options)
    fn = factory(**options)
    fn.reward_name = name
    fn.groupwise = getattr(factory, "groupwise", False)  # called with whole groups and `groups=`
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
