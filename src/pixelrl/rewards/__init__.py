"""Reward functions: `fn(images_uint8 [B,H,W,3], prompts, metadata) -> dict[str, Tensor[B]]`."""

# importing the modules registers the built-in rewards (the shapes detector and the VLM trainer's
# answer rewards register from their packages, declared in pixelrl/__init__.py)
from pixelrl.rewards import (clip, delayed, groupwise, hps, image_reward, jpeg, ocr, remote,  # noqa: F401
                             source, vlm_judge)
from pixelrl.rewards.multi import RewardSpec, WeightedReward
from pixelrl.rewards.registry import REWARDS, check_reward_output, get_reward, register_reward

__all__ = ["REWARDS", "RewardSpec", "WeightedReward", "check_reward_output", "get_reward", "register_reward"]
