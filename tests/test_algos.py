"""Advantages and losses against hand-computed numbers (docs/algorithms/notation.md)."""

import math

import pytest
import torch
from types import SimpleNamespace

from pixelrl.algos import get_advantage_estimator, get_loss, group_advantages, group_reward_stats, register_loss
from pixelrl.core.errors import ConfigError, MissingBatchKeysError

REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0])
GROUPS = ["a", "a", "b", "b"]


def test_group_advantages_global_std():
    # group means 1.5 and 3.5; population std of [1, 2, 3, 4] is sqrt(1.25)
    adv = group_advantages(REWARDS, GROUPS)
    expected = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (math.sqrt(1.25) + 1e-4)
    assert torch.allclose(adv, expected, atol=1e-6)


def test_group_advantages_group_std():
    # each group's population std is 0.5
    adv = group_advantages(REWARDS, GROUPS, global_std=False)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.5 / 0.5001, atol=1e-6)


def test_dr_grpo_does_not_divide():
    assert torch.allclose(group_advantages(REWARDS, GROUPS, norm_by_std=False), torch.tensor([-0.5, 0.5, -0.5, 0.5]))
    assert torch.allclose(get_advantage_estimator("dr_grpo")(REWARDS, GROUPS), torch.tensor([-0.5, 0.5, -0.5, 0.5]))


def test_singleton_group_gets_zero_and_integer_group_ids_work():
    adv = group_advantages(torch.tensor([1.0, 3.0, 7.0]), torch.tensor([0, 0, 5]), global_std=False)
    assert adv[2] == 0.0
    assert torch.allclose(adv[:2], torch.tensor([-1.0, 1.0]) / 1.0001, atol=1e-6)


def test_zero_std_group_gets_zero_advantage():
    adv = group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), GROUPS, global_std=False)
    assert adv[0] == 0.0 and adv[1] == 0.0


def test_group_reward_stats():
    stats = group_reward_stats(torch.tensor([2.0, 2.0, 1.0, 3.0]), GROUPS)
    assert stats == {"zero_std_ratio": 0.5, "std_mean": 0.5, "group_size": 2.0}


def test_unknown_estimator_names_the_field():
    with pytest.raises(ConfigError, match="algorithm.adv_estimator"):
        get_advantage_estimator("ppo_gae_typo")


CFG = SimpleNamespace(clip_ratio=0.05, adv_clip_max=5.0, kl_type="reference")


def _step(log_prob, old, adv):
    return {"log_prob": torch.tensor(log_prob), "old_log_prob": torch.tensor(old), "advantages": torch.tensor(adv)}


def test_flow_grpo_loss_hand_computed():
    # ratios e^0.1 = 1.10517, e^-0.2 = 0.81873; eps = 0.05
    # sample 1 (A = 1):  max(-1.10517, -1.05) = -1.05
    # sample 2 (A = -2): max(2 * 0.81873, 2 * 0.95) = 1.9
    loss, metrics = get_loss("flow_grpo")(_step([0.1, -0.2], [0.0, 0.0], [1.0, -2.0]), CFG)
    assert loss.item() == pytest.approx((-1.05 + 1.9) / 2, abs=1e-6)
    assert metrics["clipfrac"].item() == 1.0
    assert metrics["approx_kl"].item() == pytest.approx(0.5 * (0.01 + 0.04) / 2, abs=1e-7)
    assert metrics["ratio_mean"].item() == pytest.approx((1.1051709 + 0.8187308) / 2, abs=1e-6)


def test_flow_grpo_loss_unclipped_region_and_adv_clip():
    # eps = 0.2: both ratios lie inside [0.8, 1.2], so the loss is the plain -A r
    cfg = SimpleNamespace(clip_ratio=0.2, adv_clip_max=5.0)
    loss, metrics = get_loss("flow_grpo")(_step([0.1, -0.2], [0.0, 0.0], [1.0, -2.0]), cfg)
    assert loss.item() == pytest.approx((-1.1051709181 + 2 * 0.8187307531) / 2, abs=1e-6)
    assert metrics["clipfrac"].item() == 0.0
    # advantage 10 is clipped to 5: ratio 1 -> loss -5
    loss, _ = get_loss("flow_grpo")(_step([0.0], [0.0], [10.0]), cfg)
    assert loss.item() == pytest.approx(-5.0)


def test_flow_grpo_gradient_at_ratio_one_is_minus_advantage():
    log_prob = torch.tensor([0.3, -0.4], requires_grad=True)
    step = {"log_prob": log_prob, "old_log_prob": log_prob.detach(), "advantages": torch.tensor([2.0, -1.0])}
    loss, _ = get_loss("flow_grpo")(step, CFG)
    loss.backward()
    assert torch.allclose(log_prob.grad, torch.tensor([-1.0, 0.5]))


def test_is_weights_multiply_the_per_sample_loss():
    step = _step([0.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    step["is_weights"] = torch.tensor([0.5, 2.0])
    loss, _ = get_loss("flow_grpo")(step, CFG)
    assert loss.item() == pytest.approx((-0.5 - 2.0) / 2)


def test_dance_grpo_is_an_alias_of_flow_grpo():
    assert get_loss("dance_grpo") is get_loss("flow_grpo")


def test_kl_reference_and_exact_forms():
    # mean over dims of (mu - mu_ref)^2 = (1 + 4) / 2 = 2.5
    step = {"mean": torch.tensor([[1.0, 2.0]]), "ref_mean": torch.tensor([[0.0, 0.0]]),
            "std_dev_t": torch.tensor([[0.5]]), "noise_std": torch.tensor([[0.25]])}
    from pixelrl.algos.kl import step_kl_to_reference

    kl, metrics = step_kl_to_reference(step, "reference")
    assert kl.item() == pytest.approx(2.5 / (2 * 0.25))  # 5
    kl, _ = step_kl_to_reference(step, "exact")
    assert kl.item() == pytest.approx(2.5 / (2 * 0.0625))  # 20 = reference / (-dt) with sqrt(-dt) = 0.5
    with pytest.raises(ConfigError, match="kl_type"):
        step_kl_to_reference(step, "k3")
    with pytest.raises(ConfigError, match="diffusion_loss.name"):
        get_loss("kl")  # the KL is a term added to transition losses, not a loss of its own


def test_missing_step_keys_list_missing_and_available():
    with pytest.raises(MissingBatchKeysError) as err:
        get_loss("flow_grpo")({"log_prob": torch.zeros(2), "mean": torch.zeros(2)}, CFG)
    text = str(err.value)
    assert "flow_grpo" in text and "['advantages', 'old_log_prob']" in text and "['log_prob', 'mean']" in text


def test_registering_a_new_loss():
    @register_loss("test_only_negated", batch_keys=("advantages",), step_keys=("advantages",))
    def negated(step, cfg):
        return -step["advantages"].mean(), {}

    assert get_loss("test_only_negated")({"advantages": torch.tensor([2.0])}, None)[0].item() == -2.0
    with pytest.raises(ConfigError, match="diffusion_loss.name"):
        get_loss("no_such_loss")
