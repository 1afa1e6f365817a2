"""Hand-computed checks of the token-policy PPO math (vlm/token_losses.py)."""

import math

import pytest
import torch

from pixelrl.vlm import token_losses as T

ones = torch.ones


def test_gae_matches_the_hand_unrolled_recursion():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 is padding: masked out
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = T.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0: deltas 0.1, 0.1, 0.3 -> A2 = 0.3, A1 = 0.1 + 0.95 * 0.3, A0 = 0.1 + 0.95 * A1
    assert adv[0].tolist() == pytest.approx([0.46575, 0.385, 0.3])
    assert ret[0].tolist() == pytest.approx([0.96575, 0.985, 1.0])
    # row 1: V after the end is 0, so delta_1 = 2 - 0.4 = 1.6, delta_0 = 0.4 - 0.2
    assert adv[1].tolist() == pytest.approx([0.2 + 0.95 * 1.6, 1.6, 0.0])
    assert ret[1].tolist() == pytest.approx([1.92, 2.0, 0.0])
    adv, _ = T.gae(rewards[:1], values[:1], mask[:1], gamma=0.9, lam=0.5)
    # deltas: 0.3, 0.9 * 0.7 - 0.6 = 0.03, 0.9 * 0.6 - 0.5 = 0.04; gamma * lam = 0.45
    assert adv[0].tolist() == pytest.approx([0.04 + 0.45 * 0.165, 0.03 + 0.45 * 0.3, 0.3])


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_everywhere():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.1, 0.1]])
    r = T.token_rewards(torch.tensor([1.0, 2.0]), mask, kl, kl_coef=0.5)
    assert r.tolist() == [pytest.approx([-0.05, 0.9, 0.0]), pytest.approx([-0.05, -0.05, 1.95])]
    g = T.discounted_returns(r, mask, gamma=0.5)
    assert g[0].tolist() == pytest.approx([-0.05 + 0.5 * 0.9, 0.9, 0.0])
    assert g[1].tolist() == pytest.approx([-0.05 + 0.5 * (-0.05 + 0.5 * 1.95), -0.05 + 0.5 * 1.95, 1.95])


def test_sequence_estimators_by_hand():
    scores = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    a = T.sequence_baseline_advantages(scores, 4, "group_norm")
    s = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    assert a[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-6)
    assert T.sequence_baseline_advantages(scores, 4, "rloo").tolist() == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])
    assert T.sequence_baseline_advantages(scores, 4, "reinforce_baseline").tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        T.sequence_baseline_advantages(scores, 1, "rloo")


def test_whitening_styles():
    x, mask = torch.tensor([[1.0, 2, 3, 100]]), torch.tensor([[1.0, 1, 1, 0]])
    assert T.masked_whiten(x, mask).tolist()[0] == pytest.approx([-1.2247449, 0, 1.2247449, 0], rel=1e-5)
    assert T.masked_whiten(x, mask, style="verl").tolist()[0] == pytest.approx([-1, 0, 1, 0], rel=1e-5)


def test_kl_estimators():
    d = torch.tensor([[0.5, -30.0]])
    mask = torch.tensor([[1.0, 0.0]])
    zero = torch.zeros(1, 2)
    assert T.kl_estimate(d, zero, mask, "k1").tolist()[0] == [0.5, 0.0]
    assert T.kl_estimate(d, zero, mask, "k2").tolist()[0] == [0.125, 0.0]
    assert T.kl_estimate(d, zero, mask, "k3")[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5)
    big = T.kl_estimate(d, zero, ones(1, 2), "low_var_kl")
    assert big[0, 1].item() == 10.0  # exp(20) - 21 clamped
    assert T.kl_estimate(d, zero, ones(1, 2), "k3")[0, 1].item() > 1e12


def test_adaptive_kl_controller_update():
    ctl = T.AdaptiveKLController(0.1, target=0.05, horizon=100)
    ctl.update(0.06, 10)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(0.045, 10)  # error -0.1
    assert ctl.value == pytest.approx(0.102 * (1 - 0.1 * 10 / 100))
    fixed = T.FixedKLController(0.3)
    fixed.update(5.0, 100)
    assert fixed.value == 0.3


def test_aggregations():
    loss = torch.tensor([[1.0, 2, 3], [4, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    assert T.aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert T.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert T.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert T.aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 3)


def _lp(ratio):
    return torch.tensor([[math.log(ratio)]], requires_grad=True), torch.zeros(1, 1)


def test_ppo_clip_asymmetric_and_dual():
    m = ones(1, 1)
    logp, old = _lp(1.5)
    loss, metrics = T.ppo_policy_loss(logp, old, ones(1, 1), m, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28) and metrics["clipfrac"] == 1.0
    logp, old = _lp(0.5)
    loss, _ = T.ppo_policy_loss(logp, old, -ones(1, 1), m, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(0.8)
    # A < 0 and a ratio of 5: PPO gives 5, the dual clip caps it at -A c = 3 (and no gradient)
    logp, old = _lp(5.0)
    assert T.ppo_policy_loss(logp, old, -ones(1, 1), m)[0].item() == pytest.approx(5.0)
    loss, metrics = T.ppo_policy_loss(logp, old, -ones(1, 1), m, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and metrics["clipfrac_dual"] == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    # A > 0: the dual clip does nothing
    logp, old = _lp(5.0)
    assert T.ppo_policy_loss(logp, old, ones(1, 1), m, dual_clip=3.0)[0].item() == pytest.approx(-1.2)


def test_gspo_uses_the_sequence_ratio():
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    old, m = torch.zeros(1, 2), ones(1, 2)
    s = math.exp(0.2)
    loss, _ = T.gspo_loss(logp, old, ones(1, 2), m)
    assert loss.item() == pytest.approx(-(1 + 4e-4))  # clipped at 1 + 4e-4
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    logp.grad = None
    loss, _ = T.gspo_loss(logp, old, -ones(1, 2), m)
    assert loss.item() == pytest.approx(s, rel=1e-6)
    loss.backward()
    # d/dlogp_t of s_t is s (token form), averaged over the two tokens
    assert logp.grad.tolist()[0] == pytest.approx([s / 2, s / 2], rel=1e-6)


def test_cpg_clips_the_log_prob_on_the_side_the_advantage_pushes():
    m = ones(1, 1)
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = T.cpg_loss(logp, torch.tensor([[-0.5]]), ones(1, 1), m, clip=0.2)
    assert loss.item() == pytest.approx(-(-0.5 + math.log(1.2)))
    loss.backward()
    assert logp.grad.item() == 0.0
    logp = torch.tensor([[-0.5]], requires_grad=True)
    loss, _ = T.cpg_loss(logp, torch.tensor([[-0.5]]), ones(1, 1), m, clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and logp.grad.item() == pytest.approx(-1.0)
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = T.cpg_loss(logp, torch.tensor([[-0.5]]), -ones(1, 1), m, clip=0.2)
    assert loss.item() == pytest.approx(-0.5 + math.log(0.8))
    loss.backward()
    assert logp.grad.item() == 0.0


def test_value_loss_clip():
    values = torch.tensor([[1.0, 0.6]])
    old = torch.tensor([[0.5, 0.5]])
    ret = torch.tensor([[2.0, 0.0]])
    loss, metrics = T.value_loss(values, old, ret, ones(1, 2), clip=0.2)
    # token 0: V_clip = 0.7 -> max(1.69, 1.0); token 1 inside the clip: 0.36
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    assert metrics["value_clipfrac"] == 0.5
    assert T.value_loss(values, old, ret, ones(1, 2), clip=None)[0].item() == pytest.approx(0.5 * (1.0 + 0.36) / 2)


def test_ptx_entropy_mask_ema_and_explained_variance():
    assert T.ptx_loss(torch.tensor([[-1.0, -2.0], [-3.0, -50.0]]), torch.tensor([[1.0, 1], [1, 0]])).item() == 2.0
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.7]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert T.entropy_mask(ent, mask, 0.5).tolist() == [[0, 1, 0, 0]]  # max(1, int(1.5)) = 1 token
    assert T.entropy_mask(ent, mask, 0.7).tolist() == [[0, 1, 1, 0]]  # int(2.1) = 2, padding never
    assert T.entropy_mask(ent, mask, 0.0) is mask
    ema, theta = [torch.tensor([1.0])], [torch.tensor([2.0])]
    T.ema_update(ema, theta, decay=0.992)
    assert ema[0].item() == pytest.approx(1.008)
    r, m = torch.tensor([[1.0, 2, 3]]), ones(1, 3)
    assert T.explained_variance(r, r, m) == pytest.approx(1.0)
    assert T.explained_variance(torch.zeros(1, 3), r, m) == pytest.approx(0.0)


def test_whitening_over_two_ranks_equals_whitening_the_whole_batch():
    """Two ranks (threads) holding halves of a batch, summing their moments with an all-reduce,
    whiten exactly as one process holding it all; without the all-reduce each half would be
    whitened with its own moments."""
    import threading

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen) * 3 + 1
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    halves = [slice(0, 3), slice(3, 6)]
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def rank(r):
        def all_reduce(t):
            slots[r] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        for style in ("lightrft", "verl"):
            out[r] = out[r] or {}
            out[r][style] = T.masked_whiten(x[halves[r]], mask[halves[r]], style=style, all_reduce=all_reduce)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for style in ("lightrft", "verl"):
        whole = T.masked_whiten(x, mask, style=style)
        torch.testing.assert_close(torch.cat([out[0][style], out[1][style]]), whole)
        alone = T.masked_whiten(x[halves[0]], mask[halves[0]], style=style)
        assert not torch.allclose(alone, whole[halves[0]], atol=1e-3)
