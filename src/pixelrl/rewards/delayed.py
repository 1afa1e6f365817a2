"""`delayed`: another registered reward, answered after a fixed wait per image.

It stands in for a scorer that runs somewhere else (a reward server, a reward model on its own
GPU): the wait holds no CPU, so on a small machine it shows how much of a slow reward the
asynchronous trainer hides behind generation and training, in tests and in the benchmark.
"""

from __future__ import annotations

import time

from pixelrl.rewards.registry import REWARDS, check_inner_reward, check_number_option, get_reward, register_reward


@register_reward("delayed")
def delayed(reward: str = "jpeg_compressibility", seconds_per_image: float = 0.0, reward_options: dict | None = None):
    """Scores of `reward` (built with `reward_options`), returned `seconds_per_image` x batch later."""
    check_delayed_options({"reward": reward, "seconds_per_image": seconds_per_image,
                           "reward_options": reward_options}, "reward.functions[].options")
    inner = get_reward(reward, **dict(reward_options or {}))

    def score(images, prompts, metadata):
        time.sleep(seconds_per_image * len(images))
        return inner(images, prompts, metadata)

    return score


def check_delayed_options(options: dict, field: str) -> None:
    check_inner_reward(options, field, "jpeg_compressibility", [n for n in REWARDS.names() if n != "delayed"],
                       "name the reward to delay")
    check_number_option(options, field, "seconds_per_image", 0.0, lambda v: v >= 0, "a number of seconds >= 0")


delayed.check_options = check_delayed_options
