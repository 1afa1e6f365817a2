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


def test_win_rates_group_by_the_rows_uid_where_it_is_given():
    """Two rows under one instruction (two edits of different sources, or a prompt drawn twice)
    are two groups, as the advantages count them: each image is ranked within its own row."""
    batch = images(4)
    reward = WeightedReward.from_functions([{"name": "pairwise_win_rate",
                                             "options": {"reward": "jpeg_compressibility"}}])
    by_row = reward(batch, ["p"] * 4, [{}] * 4, groups=["u1", "u1", "u2", "u2"])
    inner = by_row["pairwise_win_rate/jpeg_compressibility"]
    assert by_row["pairwise_win_rate"].tolist() == [float(inner[i] > inner[i ^ 1]) for i in range(4)]
    by_prompt = reward(batch, ["p"] * 4, [{}] * 4)  # no rows (validation): one group of four
    assert by_prompt["pairwise_win_rate"].tolist() == pytest.approx([float((inner[i] > inner).sum()) / 3 for i in range(4)])
    assert group_index(["p", "p", "p"], groups=["b", "a", "b"]).tolist() == [0, 1, 0]


def test_a_rollout_hands_its_rows_uids_to_a_groupwise_reward(make_engine, tiny_pixel_path):
    """The producer scores with the request's uids: two rows of one prompt, n = 2 each, get win
    rates within each row (each row's pair sums to 1), not across the four images."""
    from pixelrl.rewards.groupwise import win_rates
    from pixelrl.trainers.step import make_rollout

    engine, cfg = make_engine(tiny_pixel_path, rollout__n=2)
    reward = WeightedReward.from_functions([{"name": "pairwise_win_rate",
                                             "options": {"reward": "jpeg_compressibility"}}])
    rollout = make_rollout(engine, reward, ["a cat", "a cat"], [{}, {}], 1, cfg, uids=["row0", "row1"])
    inner = rollout.scores["pairwise_win_rate/jpeg_compressibility"]
    assert rollout.batch["uids"] == ["row0", "row0", "row1", "row1"]
    assert torch.equal(rollout.batch["rewards"], win_rates(inner, torch.tensor([0, 0, 1, 1])))
    assert not torch.equal(rollout.batch["rewards"], win_rates(inner, torch.tensor([0, 0, 0, 0])))


def test_ray_reward_workers_score_groupwise_rewards_in_one_piece(ray_cluster):
    from pixelrl.workers.group import RewardGroup

    functions = [{"name": "pairwise_win_rate", "options": {"reward": "jpeg_compressibility"}}]
    batch = images(6, seed=1)
    whole = WeightedReward.from_functions(functions)(batch, PROMPTS, [{}] * 6)
    # two workers would take [0, 1, 2] and [3, 4, 5]: the "q" group would be cut in two
    group = RewardGroup(functions, backend="ray", placement="colocated", num_workers=2)
    try:
        scored = group(batch, PROMPTS, [{}] * 6)
        rows = ["u0"] * 3 + ["u1"] * 3  # the rows' uids reach the worker's reward too
        by_row = group(batch, PROMPTS, [{}] * 6, groups=rows)
    finally:
        group.shutdown()
    assert torch.equal(scored["pairwise_win_rate"], whole["pairwise_win_rate"])
    assert torch.equal(by_row["pairwise_win_rate"],
                       WeightedReward.from_functions(functions)(batch, PROMPTS, [{}] * 6, groups=rows)["pairwise_win_rate"])
    assert not torch.equal(by_row["pairwise_win_rate"], whole["pairwise_win_rate"])


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


@pytest.mark.parametrize("mode", [(), ("rollout.n_workers=1", "trainer.mode=async", "trainer.max_staleness=0")],
                         ids=["colocated", "rollout_pool"])
def test_two_rows_of_one_prompt_are_ranked_apart_in_training(tmp_path, tiny_pixel_path, mode):
    """One prompt in both rows of the batch, 2 images each: with the rows' uids reaching
    the reward (on the pool, through the in-flight scoring too) each row's pair gets win rates 0
    and 1, a within-row std of 1/2; by prompt they would be 0, 1/3, 2/3 and 1, and no split of
    those into two pairs has a mean within-row std of 1/2."""
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "data.train_files=[]", "data.prompts=['a cat', 'a cat']", "data.train_batch_size=2",
                          "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
                          "trainer.save_freq=-1", "reward.functions=[{name: pairwise_win_rate, options: "
                          "{reward: jpeg_compressibility}}]", *mode)
    assert code == 0
    (metrics,) = read_metrics(run)
    assert metrics["critic/rewards/std_mean"] == 0.5
