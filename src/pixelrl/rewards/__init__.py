"""Reward functions: `fn(images_uint8 [B,H,W,3], prompts, metadata) -> dict[str, Tensor[B]]`."""

# importing the modules registers the built-in rewards
from pixelrl.rewards import (answers, clip, delayed, groupwise, hps, image_reward, jpeg, ocr,  # noqa: F401
                             remote, shapes, vlm_judge, vlm_reward_model)
from pixelrl.rewards.multi import RewardSpec, WeightedReward
from pixelrl.rewards.registry import REWARDS, check_reward_output, get_reward, register_reward

__all__ = ["REWARDS", "RewardSpec", "WeightedReward", "check_reward_output", "get_reward", "register_reward"]
