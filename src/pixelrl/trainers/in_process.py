"""Flow-GRPO in one process, no Ray: the engine is the actor. Used by the demo, the tests
and anyone debugging an algorithm before scaling it out."""

from __future__ import annotations

from typing import Callable

import torch

from pixelrl.core.config import PixelRLConfig
from pixelrl.core.seeding import seed_everything
from pixelrl.engine import PolicyEngine
from pixelrl.models import load_model
from pixelrl.rewards import RewardSpec, WeightedReward
from pixelrl.trainers.step import policy_gradient_step


def build_engine(cfg: PixelRLConfig) -> PolicyEngine:
    model = load_model(cfg.model.type, cfg.model.path, device=cfg.model.device, dtype=cfg.model.dtype,
                       max_sequence_length=cfg.model.max_sequence_length)
    return PolicyEngine(model, cfg)


def build_reward(cfg: PixelRLConfig) -> WeightedReward:
    return WeightedReward([RewardSpec(f["name"], f.get("weight", 1.0), f.get("options", {}))
                           for f in cfg.reward.functions])


def prompt_batches(prompts: list[str], batch_size: int, step: int) -> list[str]:
    """The prompts of `step` (1-based), cycling through the list in order."""
    start = ((step - 1) * batch_size) % len(prompts)
    return [prompts[(start + i) % len(prompts)] for i in range(batch_size)]


@torch.no_grad()
def mean_reward(engine: PolicyEngine, reward: WeightedReward, prompts: list[str], seeds: list[int]) -> float:
    """Mean overall reward of one image per (prompt, seed): a fixed-seed evaluation."""
    batch = engine.rollout(prompts, seeds)
    return float(reward(batch["images"], prompts, [{}] * len(prompts))["overall"].mean())


def train_in_process(cfg: PixelRLConfig, engine: PolicyEngine | None = None, reward: WeightedReward | None = None,
                     on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run `cfg.trainer.total_training_steps` Flow-GRPO steps over `cfg.data.prompts`."""
    if not cfg.data.prompts:
        from pixelrl.core.errors import ConfigError

        raise ConfigError("data.prompts", cfg.data.prompts, "give at least one prompt")
    seed_everything(cfg.seed)
    engine = engine or build_engine(cfg)
    reward = reward or build_reward(cfg)
    history = []
    for step in range(1, cfg.trainer.total_training_steps + 1):
        prompts = prompt_batches(cfg.data.prompts, cfg.data.train_batch_size, step)
        _, metrics = policy_gradient_step(engine, reward, prompts, [{}] * len(prompts), step, cfg)
        metrics["training/global_step"] = step
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
