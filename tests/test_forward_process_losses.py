"""Diffusion-DPO, DiffusionNFT and AWM losses against hand-computed numbers."""

import math

import pytest
import torch

from pixelrl.algos import get_loss
from pixelrl.algos.forward_process import awm_log_prob, nft_optimality
from pixelrl.algos.config import DiffusionLossConfig
from pixelrl.core.errors import ConfigError


def _options(name, **params):
    return get_loss(name).bind(DiffusionLossConfig(name=name, params=params))


def test_diffusion_dpo_at_known_errors():
    step = {"err_chosen": torch.tensor([0.10, 0.20]), "ref_err_chosen": torch.tensor([0.12, 0.20]),
            "err_rejected": torch.tensor([0.15, 0.10]), "ref_err_rejected": torch.tensor([0.14, 0.12])}
    loss, m = get_loss("diffusion_dpo")(step, _options("diffusion_dpo"))  # beta 100
    # pair 1: chosen -50 (0.10 - 0.12) = 1, rejected -50 (0.15 - 0.14) = -0.5, inside 1.5
    # pair 2: chosen 0, rejected -50 (0.10 - 0.12) = 1, inside -1
    expected = (math.log1p(math.exp(-1.5)) + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    assert m["implicit_acc"].item() == 0.5 and m["reward_margin"].item() == pytest.approx(0.25, abs=1e-5)
    assert m["rewards_chosen"].item() == pytest.approx(0.5, abs=1e-5)
    assert m["rewards_rejected"].item() == pytest.approx(0.25, abs=1e-5)


def test_diffusion_dpo_gradient_only_through_the_policy_errors():
    err_w = torch.tensor([0.1], requires_grad=True)
    ref_w = torch.tensor([0.1], requires_grad=True)
    step = {"err_chosen": err_w, "ref_err_chosen": ref_w, "err_rejected": torch.tensor([0.1]),
            "ref_err_rejected": torch.tensor([0.1])}
    loss, _ = get_loss("diffusion_dpo")(step, _options("diffusion_dpo", beta=2.0))
    loss.backward()
    # d/d err_w of -log sigmoid(-(err_w - ref_w)) at 0: sigmoid(0) * 1 = 0.5
    assert err_w.grad.item() == pytest.approx(0.5) and ref_w.grad is None


def test_nft_optimality_modes():
    adv = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    expected = {
        "all": [0.0, 0.25, 0.5, 0.75, 1.0],
        "positive_only": [0.5, 0.5, 0.5, 0.75, 1.0],
        "negative_only": [0.0, 0.25, 0.5, 0.5, 0.5],
        "one_only": [0.5, 0.5, 0.5, 0.6, 0.6],
        "binary": [0.4, 0.4, 0.5, 0.6, 0.6],
    }
    for mode, values in expected.items():
        assert torch.allclose(nft_optimality(adv, 5.0, mode), torch.tensor(values)), mode
    with pytest.raises(ConfigError, match="adv_mode"):
        _options("diffusion_nft", adv_mode="sometimes")


def test_diffusion_nft_loss_and_gradient_hand_computed():
    v = torch.tensor([[1.0]], requires_grad=True)
    step = {"x0": torch.tensor([[0.0]]), "x_t": torch.tensor([[1.0]]), "t": torch.tensor([0.5]), "v": v,
            "v_old": torch.tensor([[0.6]]), "v_ref": torch.tensor([[0.8]]), "advantages": torch.tensor([2.5])}
    loss, m = get_loss("diffusion_nft")(step, _options("diffusion_nft"))  # beta 1, ref_kl 1e-4, c 5
    # r = 0.75; x0+ = 1 - 0.5 * 1 = 0.5 -> 0.25 / 0.5 = 0.5; v- = 2 * 0.6 - 1 = 0.2, x0- = 0.9 -> 0.81 / 0.9 = 0.9
    # policy = 5 (0.75 * 0.5 + 0.25 * 0.9) = 3; KL = (1 - 0.8)^2 = 0.04
    assert m["policy_loss"].item() == pytest.approx(3.0, abs=1e-6)
    assert loss.item() == pytest.approx(3.0 + 1e-4 * 0.04, abs=1e-6)
    loss.backward()
    # the adaptive weights are constants: 5 (0.75 * 2 * 0.5 * -0.5 / 0.5 + 0.25 * 2 * 0.9 * 0.5 / 0.9) + 1e-4 * 2 * 0.2
    assert v.grad.item() == pytest.approx(-3.75 + 1.25 + 4e-5, abs=1e-6)


def test_awm_ghuber_log_prob_and_gradient_hand_computed():
    err = torch.tensor([0.25], dtype=torch.float64)
    t = torch.tensor([0.6])
    assert awm_log_prob(err, t).item() == pytest.approx(-0.6 * (0.25 ** 0.25 - 1e-10 ** 0.25) / 0.25, rel=1e-6)
    assert awm_log_prob(err, t, "uniform").item() == -0.25
    assert awm_log_prob(err, t, "t").item() == pytest.approx(-0.6 * 0.25)
    assert awm_log_prob(err, t, "t**2").item() == pytest.approx(-0.36 * 0.25)
    assert awm_log_prob(err, t, "huber").item() == pytest.approx(-0.6 * (0.5 - 1e-5), rel=1e-6)
    v = torch.tensor([[1.0, 0.0]], requires_grad=True)
    step = {"x0": torch.zeros(1, 2), "eps": torch.tensor([[0.5, 0.5]]), "t": t, "v": v,
            "v_ref": v.detach().clone(), "v_old": v.detach().clone(), "advantages": torch.tensor([2.5])}
    loss, m = get_loss("awm")(step, _options("awm"))
    assert loss.item() == pytest.approx(-0.5)  # -A' with A' = 2.5 / 5 and ratio 1 in value
    assert m["fm_error"].item() == pytest.approx(0.25)
    loss.backward()
    # -A' d logp / dv = 0.5 * 0.6 * 0.25^(-0.75) * (v - target), target (0.5, 0.5)
    g = 0.5 * 0.6 * 0.25 ** -0.75 * 0.5
    assert torch.allclose(v.grad, torch.tensor([[g, -g]]), atol=1e-6)


def test_awm_reference_and_ema_terms():
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    step = {"x0": torch.zeros(1, 2), "eps": torch.tensor([[1.0, 1.0]]), "t": torch.tensor([0.5]), "v": v,
            "v_ref": torch.tensor([[0.0, 1.0]]), "v_old": torch.tensor([[1.0, 0.0]]), "advantages": torch.tensor([0.0])}
    loss, m = get_loss("awm")(step, _options("awm", beta_ref=0.1, ema_beta=2.0))
    # err 0 and A 0: only 0.1 * mean((1, 0)) + 2 * mean((0, 1)) = 0.05 + 1
    assert loss.item() == pytest.approx(1.05)
    assert m["ref_deviation"].item() == pytest.approx(0.5) and m["ema_deviation"].item() == pytest.approx(0.5)


def test_awm_terms_with_zero_weight_need_no_velocity():
    spec = get_loss("awm")
    assert set(spec.step_keys_needed(_options("awm"))) >= {"v_ref", "v_old"}
    assert "v_ref" not in spec.step_keys_needed(_options("awm", beta_ref=0.0))
    assert "v_old" in spec.step_keys_needed(_options("awm", beta_ref=0.0))
    options = _options("awm", beta_ref=0.0, ema_beta=0.0)
    assert not {"v_ref", "v_old"} & set(spec.step_keys_needed(options))
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    step = {"x0": torch.zeros(1, 2), "eps": torch.tensor([[1.0, 1.0]]), "t": torch.tensor([0.5]), "v": v,
            "v_ref": None, "v_old": None, "advantages": torch.tensor([0.0])}
    loss, m = spec(step, options)  # err 0 and A 0: nothing left
    assert loss.item() == 0.0 and "ref_deviation" not in m and "ema_deviation" not in m


def test_loss_params_are_validated_by_name():
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params.*betta"):
        _options("diffusion_dpo", betta=5)
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params\.beta"):
        _options("diffusion_nft", beta=0.0)
    with pytest.raises(ConfigError, match="takes no params"):
        _options("flow_grpo", tau=1.0)


def _reference_dgpo(model_v, ref_v, target_v, advantages, group_ids, beta_dpo, group_size):
    """A transcription of the reference's compute_group_dgpo_loss_allreduce (Luo-Yihong/DGPO,
    scripts/train_sd3_dgpo.py) on one process: the all-reduce of the group sums is the sum itself."""
    b = model_v.shape[0]
    dsm = (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    with torch.no_grad():
        ref = (target_v - ref_v).square().reshape(b, -1).mean(dim=1)
    per_sample = advantages * beta_dpo * (dsm.detach() - ref.detach()) / group_size
    sums = torch.zeros(int(group_ids.max()) + 1, dtype=per_sample.dtype).scatter_add_(0, group_ids, per_sample)
    weights = torch.sigmoid(sums)[group_ids]
    return (weights.detach() * advantages * dsm).mean()


def _dgpo_step(seed=0, b=6, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(b, 2, 3, 3, generator=gen, dtype=dtype), torch.randn(b, 2, 3, 3, generator=gen, dtype=dtype)
    v = (eps - x0 + 0.3 * torch.randn(b, 2, 3, 3, generator=gen, dtype=dtype)).requires_grad_()
    v_ref = eps - x0 + 0.3 * torch.randn(b, 2, 3, 3, generator=gen, dtype=dtype)
    adv = torch.tensor([1.2, -0.4, -0.8, 0.9, 0.1, -1.0], dtype=dtype)[:b]
    groups = torch.tensor([0, 0, 0, 1, 1, 1])[:b]
    return {"x0": x0, "eps": eps, "v": v, "v_ref": v_ref, "v_old": None, "advantages": adv, "groups": groups}


def test_dgpo_loss_and_gradient_equal_a_transcription_of_the_reference():
    step = _dgpo_step()
    options = _options("dgpo", beta_dpo=101.0, ref_kl_coef=0.0, clip_range=0.0)
    loss, metrics = get_loss("dgpo")(step, options)
    (grad,) = torch.autograd.grad(loss, step["v"])
    v = step["v"].detach().clone().requires_grad_()
    expected = _reference_dgpo(v, step["v_ref"], step["eps"] - step["x0"], step["advantages"], step["groups"],
                               101.0, group_size=3)
    (expected_grad,) = torch.autograd.grad(expected, v)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert float(metrics["policy_loss"]) == pytest.approx(float(expected.detach()), rel=1e-12)


def test_dgpo_hand_computed_on_one_group_of_two():
    """Errors 1 and 3 against reference errors 2 and 2, advantages +1 and -1, beta 0.5: the group
    term is (1 * 0.5 * (1 - 2) + (-1) * 0.5 * (3 - 2)) / 2 = -0.5, w = sigmoid(-0.5), and
    L = w (1 * 1 - 1 * 3) / 2 = -w."""
    x0 = torch.zeros(2, 1)
    step = {"x0": x0, "eps": torch.zeros(2, 1), "v": torch.tensor([[1.0], [math.sqrt(3.0)]], requires_grad=True),
            "v_ref": torch.tensor([[math.sqrt(2.0)], [math.sqrt(2.0)]]), "v_old": None,
            "advantages": torch.tensor([1.0, -1.0]), "groups": torch.tensor([0, 0])}
    loss, metrics = get_loss("dgpo")(step, _options("dgpo", beta_dpo=0.5, ref_kl_coef=0.0, clip_range=0.0))
    w = 1 / (1 + math.exp(0.5))
    assert float(loss.detach()) == pytest.approx(-w, rel=1e-6)
    assert float(metrics["group_weight"]) == pytest.approx(w, rel=1e-6)


def test_dgpo_holds_the_error_where_the_ratio_to_the_ema_leaves_the_clip_and_adds_the_reference_kl():
    step = _dgpo_step()
    # the EMA's error: far below the policy's on sample 0 (A > 0: ratio exp(d_old - d) < 1, free),
    # far above on sample 3 (A > 0: ratio > 1 + clip, held), equal elsewhere (ratio 1, free)
    target = step["eps"] - step["x0"]
    v_old = step["v"].detach().clone()
    v_old[0] = target[0]
    v_old[3] = target[3] + 3.0
    step["v_old"] = v_old
    loss, metrics = get_loss("dgpo")(step, _options("dgpo", beta_dpo=101.0, ref_kl_coef=0.0, clip_range=0.01))
    (grad,) = torch.autograd.grad(loss, step["v"])
    assert float(metrics["clipfrac"]) == pytest.approx(1 / 6)
    assert torch.count_nonzero(grad[3]) == 0 and torch.count_nonzero(grad[0]) > 0
    kl_step = _dgpo_step()
    with_kl, kl_metrics = get_loss("dgpo")(kl_step, _options("dgpo", ref_kl_coef=0.02, clip_range=0.0))
    without, _ = get_loss("dgpo")(_dgpo_step(), _options("dgpo", ref_kl_coef=0.0, clip_range=0.0))
    kl = ((kl_step["v"] - kl_step["v_ref"]) ** 2).reshape(6, -1).mean(1).mean()
    assert float((with_kl - without).detach()) == pytest.approx(0.02 * float(kl.detach()), rel=1e-9)
    assert float(kl_metrics["ref_deviation"]) == pytest.approx(float(kl.detach()), rel=1e-9)


def test_dgpo_timesteps_are_distinct_high_noise_grid_indices_shared_by_every_sample():
    from pixelrl.algos.forward_process import draw_timesteps

    grid = torch.linspace(1.0, 0.1, 10)
    seen = set()
    for seed in range(20):
        t = draw_timesteps("grid_subset", 5, grid=grid, train_sigmas=grid, num_timesteps=4, max_index=4,
                           generator=torch.Generator().manual_seed(seed))
        assert t.shape == (5, 4) and bool((t == t[0]).all())  # one draw for the whole update
        indices = [int((grid - v).abs().argmin()) for v in t[0]]
        assert len(set(indices)) == 4 and max(indices) <= 4
        seen |= set(indices)
    assert seen == {0, 1, 2, 3, 4}
    with pytest.raises(ConfigError, match="num_timesteps"):
        _options("dgpo", num_timesteps=6, max_timestep_index=4)
