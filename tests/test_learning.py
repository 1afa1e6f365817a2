"""Honest learning test: a few Flow-GRPO steps through the trainer (one process) raise the
JPEG-compressibility reward of the policy on unseen seeds."""

import pytest

from pixelrl.engine import PolicyEngine
from pixelrl.engine.checkpoint import load_engine
from pixelrl.engine.evaluate import fixed_seed_reward
from pixelrl.rewards import WeightedReward
from pixelrl.trainers.controller import DiffusionTrainer

from conftest import assert_learned, tiny_config

PROMPTS = ["a red circle", "two blue squares", "a cat", "a house"]


@pytest.mark.learning
def test_flow_grpo_raises_jpeg_compressibility_on_the_tiny_model(tiny_pixel_path, tmp_path):
    cfg = tiny_config(tiny_pixel_path)
    cfg.data.prompts = PROMPTS
    cfg.data.train_batch_size = 4
    cfg.trainer.total_training_steps = 16
    cfg.trainer.backend = "local"
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.default_local_dir = str(tmp_path)
    engine, reward = PolicyEngine.from_config(cfg), WeightedReward.from_functions(cfg.reward.functions)
    eval_prompts, eval_seeds = PROMPTS * 4, list(range(10_000, 10_016))  # fixed, unseen in training
    before = fixed_seed_reward(engine, reward, eval_prompts, eval_seeds)
    result = DiffusionTrainer(cfg).fit()
    load_engine(engine, f"{result['run_dir']}/checkpoints/global_step_16/actor")
    after = fixed_seed_reward(engine, reward, eval_prompts, eval_seeds)
    history = result["history"]
    train = [m["critic/rewards/mean"] for m in history]
    # rewards are -size in kB (~ -1.9 at start); demand a clear, not a noise-level, gain
    assert_learned(before, after, 0.04)
    assert sum(train[-4:]) / 4 > sum(train[:4]) / 4 + 0.02, train
    assert all(m["actor/skipped_nonfinite"] == 0.0 for m in history)
