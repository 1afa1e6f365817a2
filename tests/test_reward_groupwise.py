"""Group-wise rewards: win rates by hand, whole groups in every call (also across Ray reward
workers, where a plain split would cut a group), and a training run on them."""

import numpy as np
import pytest
import torch

from conftest import read_metrics, train_cli
from pixelrl.core.errors import ConfigError
from pixelrl.rewards import WeightedReward, get_reward
from pixelrl.rewards.groupwise import group_index, win_rates


def test_win_rates_by_hand():
    scores = torch.tensor([0.1, 0.5, 0.5, 0.9, 3.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0: 0.1 beats none of 3; each 0.5 beats 0.1 and ties the other (1.5 / 3); 0.9 beats all
    # group 1: 3.0 beats 2.0; group 2 has one image: 1/2
    assert win_rates(scores, groups).tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.5]
    assert group_index(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def images(batch, seed=0):
    rng = np.random.default_rng(seed)
    # images of different detail so their JPEG sizes differ
    return torch.from_numpy(np.stack([rng.integers(0, 256 // (i + 1), (16, 16, 3)) for i in range(batch)]).astype(np.uint8))


PROMPTS = ["p", "p", "q", "q", "r", "r"]


def test_win_rate_of_an_inner_reward_within_prompts():
    batch = images(6)
    reward = WeightedReward.from_functions([{"name": "pairwise_win_rate",
                                             "options": {"reward": "jpeg_compressibility"}}])
    out = reward(batch, PROMPTS, [{}] * 6)
    inner = out["pairwise_win_rate/jpeg_compressibility"]
    expected = [float(inner[i] > inner[i ^ 1]) for i in range(6)]  # pairs (0,1), (2,3), (4,5); no ties here
    assert out["pairwise_win_rate"].tolist() == expected
    assert torch.equal(out["overall"], out["pairwise_win_rate"])
    with pytest.raises(ConfigError, match="options.reward"):
        get_reward("pairwise_win_rate", reward="pairwise_win_rate")


def test_ray_reward_workers_score_groupwise_rewards_in_one_piece(ray_cluster):
    from pixelrl.workers.group import RewardGroup

    functions = [{"name": "pairwise_win_rate", "options": {"reward": "jpeg_compressibility"}}]
    batch = images(6, seed=1)
    whole = WeightedReward.from_functions(functions)(batch, PROMPTS, [{}] * 6)
    # two workers would take [0, 1, 2] and [3, 4, 5]: the "q" group would be cut in two
    group = RewardGroup(functions, backend="ray", placement="colocated", num_workers=2)
    try:
        scored = group(batch, PROMPTS, [{}] * 6)
    finally:
        group.shutdown()
    assert torch.equal(scored["pairwise_win_rate"], whole["pairwise_win_rate"])


def test_training_on_win_rates(tmp_path, tiny_pixel_path):
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
                          "trainer.save_freq=-1", "reward.functions=[{name: pairwise_win_rate, options: "
                          "{reward: jpeg_compressibility, reward_options: {scale: 0.002}}}]")
    assert code == 0
    metrics = read_metrics(run)
    # every group's win rates average 1/2 (each comparison gives 1 to one side), so the mean is 1/2
    assert [m["critic/rewards/mean"] for m in metrics] == pytest.approx([0.5, 0.5])
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
