"""The vision-language trainer's reward shaping: DAPO's overlong penalty and dynamic sampling,
LightRFT's running reward normalisation and clip, by hand and through the engine."""

import math

import numpy as np
import pytest
import torch

from conftest import vlm_config

from pixelrl.core.errors import ConfigError
from pixelrl.vlm.reward_shaping import RunningMoments, group_rows, informative_groups, overlong_penalty


def test_the_overlong_penalty_ramps_over_the_buffer_by_hand():
    """L_max 8, buffer 4: nothing up to 4 tokens, then -(L - 4) / 4 x factor down to -factor at 8."""
    lengths = torch.tensor([3, 4, 5, 7, 8])
    assert overlong_penalty(lengths, 8, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]


def test_a_group_whose_rewards_all_agree_is_uninformative():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert informative_groups(rewards, 4).tolist() == [True, False, False]
    assert group_rows(torch.tensor([0, 2]), 4).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


def test_running_moments_equal_the_statistics_of_everything_seen_by_hand():
    """[1, 2, 3, 4] then [10]: the mean of all five is 4 and their sample std sqrt(50 / 4); summing
    over two ranks that saw the same batch counts it twice (the same mean, n = 8)."""
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert moments.mean == pytest.approx(2.5) and moments.std == pytest.approx(math.sqrt(5 / 3))
    moments.update(torch.tensor([10.0]))
    assert moments.mean == pytest.approx(4.0) and moments.std == pytest.approx(math.sqrt(12.5))
    assert moments.normalize(torch.tensor([4.0]), subtract_mean=True).item() == pytest.approx(0.0)
    assert moments.normalize(torch.tensor([4.0]), subtract_mean=False).item() == pytest.approx(4 / math.sqrt(12.5))
    twice = RunningMoments()
    twice.update(torch.tensor([1.0, 2.0, 3.0, 4.0]), all_reduce=lambda totals: 2 * totals)
    assert twice.count == pytest.approx(8) and twice.mean == pytest.approx(2.5)
    assert twice.std == pytest.approx(math.sqrt(1.25 * 8 / 7))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.mean, restored.std) == (moments.mean, moments.std)


def test_concatenated_samples_score_as_they_did_apart(tiny_vlm_path):
    """Two sampled batches with prompts and responses of other lengths, joined with padding: every
    row's response tokens get the log-probs they had in their own batch."""
    from pixelrl.models.qwen_vl import QwenVLModel, TokenBatch

    model = QwenVLModel(tiny_vlm_path)
    image = np.full((32, 32, 3), 128, np.uint8)
    short = model.generate(model.prompts([image, image], ["is it red", "how many"]), seed=1, max_new_tokens=3)
    long = model.generate(model.prompts([image], ["is there a red circle left of a blue square"]), seed=2,
                          max_new_tokens=5)
    joined = TokenBatch.concat([short, long], model.pad_id)
    assert len(joined) == 3 and joined.prompt_length == long.prompt_length
    apart = [model.token_logprobs(short), model.token_logprobs(long)]
    together = model.token_logprobs(joined)
    for rows, part, logp in ((slice(0, 2), short, apart[0]), (slice(2, 3), long, apart[1])):
        width = part.response_mask.shape[1]
        mask = part.response_mask.bool()
        assert torch.equal(joined.response_mask[rows, :width], part.response_mask)
        assert torch.allclose(together[rows, :width][mask], logp[mask], atol=1e-5)
        assert joined.response_mask[rows, width:].sum() == 0


def _engine_with_reward(tmp_path, tiny_vlm_path, rewards_of, *overrides):
    """A tiny VLM engine whose reward is a function of each response's item (its `round` and group)."""
    from pixelrl.vlm.engine import VLMEngine

    engine = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, "data.train_batch_size=2", "rollout.n=2",
                                  "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4", *overrides))
    engine.reward = lambda texts, questions, meta: {"overall": torch.tensor([rewards_of(m) for m in meta])}
    return engine


def _items(round_, image):
    return [{"image": image, "question": "is it red", "round": round_, "group": g} for g in range(2)]


def test_dynamic_sampling_refills_the_share_with_groups_that_teach(tiny_vlm_path, tmp_path):
    """Round 0: group 0 answers alike (reward 1, 1), group 1 differs; round 1: both differ. The
    share of two groups is round 0's group 1 and round 1's group 0, in that order, after two rounds."""
    image = np.full((32, 32, 3), 128, np.uint8)
    calls = {"n": 0}

    def reward(meta):
        calls["n"] += 1
        if meta["round"] == 0 and meta["group"] == 0:
            return 1.0
        return float(calls["n"] % 2)  # the two samples of a group get 1 and 0

    engine = _engine_with_reward(tmp_path, tiny_vlm_path, reward, "vlm.dynamic_sampling_rounds=3")
    exp, metrics = engine.make_experience(_items(0, image), 1, more_items=lambda k: _items(k, image))
    assert metrics["dynamic_sampling/rounds"] == 2
    assert metrics["dynamic_sampling/informative_share"] == 0.5
    assert metrics["dynamic_sampling/filled_groups"] == 0
    assert len(exp) == 4
    advantages = exp.advantages.sum(1) / exp.batch.response_mask.sum(1)
    assert torch.all(advantages.abs() > 0.5)  # every kept group has a nonzero group-relative advantage


def test_a_share_still_short_after_the_last_round_is_filled_with_dropped_groups(tiny_vlm_path, tmp_path):
    image = np.full((32, 32, 3), 128, np.uint8)
    engine = _engine_with_reward(tmp_path, tiny_vlm_path, lambda meta: 1.0, "vlm.dynamic_sampling_rounds=2")
    exp, metrics = engine.make_experience(_items(0, image), 1, more_items=lambda k: _items(k, image))
    assert (metrics["dynamic_sampling/rounds"], metrics["dynamic_sampling/filled_groups"]) == (2, 2)
    assert len(exp) == 4 and torch.all(exp.advantages == 0)  # uniform rewards: nothing to learn, as masked


def test_the_reward_processing_normalises_and_clips_what_enters_the_advantage(tiny_vlm_path, tmp_path):
    """reinforce_baseline's shaped rewards (r - group mean) are divided by their running std and
    clipped."""
    image = np.full((32, 32, 3), 128, np.uint8)
    values = iter([1.0, 0.0, 3.0, 0.0])
    engine = _engine_with_reward(tmp_path, tiny_vlm_path, lambda meta: next(values), "vlm.estimator=reinforce_baseline",
                                 "vlm.reward_running_norm=true", "vlm.reward_clip=1.0")
    exp, metrics = engine.make_experience(_items(0, image), 1)
    shaped = torch.tensor([0.5, -0.5, 1.5, -1.5])
    std = shaped.std().item()  # the running std after the first batch: that batch's sample std
    assert metrics["critic/reward_running_std"] == pytest.approx(std, rel=1e-6)
    assert metrics["critic/reward_clip_frac"] == 0.5  # +-1.5 / 1.29 is beyond the clip
    assert engine.reward_moments.count == pytest.approx(4)


def test_the_overlong_penalty_is_added_to_each_responses_reward(tiny_vlm_path, tmp_path, monkeypatch):
    """A constant reward of 1 and a buffer of 3 of vlm.max_new_tokens=4: the reward the group
    baseline receives is 1 + each response's penalty (caught where the engine hands it over)."""
    from pixelrl.vlm import engine as vlm_engine

    image = np.full((32, 32, 3), 128, np.uint8)
    engine = _engine_with_reward(tmp_path, tiny_vlm_path, lambda meta: 1.0, "vlm.overlong_buffer=3")
    seen = {}
    baseline = vlm_engine.T.sequence_baseline_advantages
    monkeypatch.setattr(vlm_engine.T, "sequence_baseline_advantages",
                        lambda score, n, estimator: seen.setdefault("score", score) is not None and
                        baseline(score, n, estimator))
    exp, metrics = engine.make_experience(_items(0, image), 1)
    penalty = overlong_penalty(exp.batch.response_mask.sum(1), 4, 3, 1.0)
    assert torch.all(penalty <= -1 / 3)  # every response reaches the buffer (at least 2 of 4 tokens)
    assert torch.allclose(seen["score"], 1 + penalty)
    assert metrics["response/overlong_penalty"] == pytest.approx(float(penalty.mean()))
    assert metrics["response/overlong_share"] == 1.0


@pytest.mark.parametrize("override, says", [
    ("vlm.overlong_buffer=4", "before vlm.max_new_tokens=4"),
    ("vlm.reward_running_norm_minus_mean=true", "reward_running_norm=true"),
    ("vlm.dynamic_sampling_rounds=2", "group baseline"),
    ("vlm.reward_clip=-1", "vlm.reward_clip"),
])
def test_shaping_options_that_cannot_work_are_refused_by_name(tiny_vlm_path, tmp_path, override, says):
    extra = ["vlm.estimator=gae"] if "dynamic" in override else []
    with pytest.raises(ConfigError, match=says):
        vlm_config(tiny_vlm_path, tmp_path, override, *extra)
