"""The gradient noise scale estimator (pixelrl.shapes.gradient_noise): hand-computed values and
recovery of a known signal and noise."""

import math

import pytest
import torch

from pixelrl.shapes.gradient_noise import gradient_noise_scale


def test_hand_computed_two_parallel_gradients():
    # g = (3, 0), (1, 0) from b = 4 samples each: B = 8, mean |g|^2 = 5, |G_B|^2 = 4
    # |G|^2 = (8 * 4 - 4 * 5) / (8 - 4) = 3; tr S = (5 - 4) / (1/4 - 1/8) = 8; B_noise = 8 / 3
    out = gradient_noise_scale([torch.tensor([3.0, 0.0]), torch.tensor([1.0, 0.0])], samples_per_grad=4)
    assert out["grad_sq"] == pytest.approx(3.0)
    assert out["trace_cov"] == pytest.approx(8.0)
    assert out["noise_scale"] == pytest.approx(8.0 / 3.0)
    assert out["pairwise_cosine"] == pytest.approx(1.0)


def test_orthogonal_single_sample_gradients_are_all_noise():
    # g = (1, 0), (0, 1), b = 1: |G|^2 = (2 * 0.5 - 1) / 1 = 0, tr S = (1 - 0.5) / (1 - 1/2) = 1
    out = gradient_noise_scale([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], samples_per_grad=1)
    assert out["grad_sq"] == pytest.approx(0.0)
    assert out["trace_cov"] == pytest.approx(1.0)
    assert math.isinf(out["noise_scale"])
    assert out["pairwise_cosine"] == pytest.approx(0.0)


def test_recovers_a_known_signal_and_noise():
    # per-sample gradient = G + N(0, sigma^2 I) in P dims: tr S = sigma^2 P, B_noise = sigma^2 P / |G|^2
    gen = torch.Generator().manual_seed(0)
    P, sigma, b, K = 400, 0.5, 16, 200
    G = torch.zeros(P)
    G[:4] = 0.5  # |G|^2 = 1
    grads = [G + sigma * torch.randn(b, P, generator=gen).mean(0) for _ in range(K)]
    out = gradient_noise_scale(grads, samples_per_grad=b)
    assert out["grad_sq"] == pytest.approx(1.0, rel=0.1)
    assert out["trace_cov"] == pytest.approx(sigma ** 2 * P, rel=0.1)
    assert out["noise_scale"] == pytest.approx(100.0, rel=0.15)
    assert 50.0 < out["noise_scale_lower"] < 100.0
    # two independent 16-sample gradients: cosine ~ 1 / (1 + B_noise / b)
    assert out["pairwise_cosine"] == pytest.approx(1 / (1 + 100 / 16), abs=0.03)


def test_jackknife_bound_hand_computed():
    # 1-D gradients 1, 3, 2 from b = 1 sample each. All three: |G|^2 = (3 * 4 - 14/3) / 2 = 11/3,
    # tr S = (14/3 - 4) / (1 - 1/3) = 1. Leaving one out: {3, 2} -> 2 * 6.25 - 6.5 = 6,
    # {1, 2} -> 4.5 - 2.5 = 2, {1, 3} -> 8 - 5 = 3; mean 11/3, squared deviations 49/9, 25/9, 4/9:
    # se = sqrt(2/3 * 78/9) = sqrt(52) / 3; bound = 1 / (11/3 + 2 se)
    out = gradient_noise_scale([torch.tensor([1.0]), torch.tensor([3.0]), torch.tensor([2.0])], samples_per_grad=1)
    se = math.sqrt(52) / 3
    assert out["grad_sq"] == pytest.approx(11 / 3)
    assert out["grad_sq_se"] == pytest.approx(se)
    assert out["noise_scale"] == pytest.approx(3 / 11)
    assert out["noise_scale_lower"] == pytest.approx(1 / (11 / 3 + 2 * se))


def test_two_gradients_give_no_bound():
    out = gradient_noise_scale([torch.tensor([3.0, 0.0]), torch.tensor([1.0, 0.0])], samples_per_grad=4)
    assert "noise_scale_lower" not in out


@pytest.mark.parametrize("grads,b", [([torch.ones(3)], 4), ([torch.ones(3), torch.ones(3)], 0)])
def test_refuses_too_few_gradients_or_samples(grads, b):
    with pytest.raises(ValueError):
        gradient_noise_scale(grads, samples_per_grad=b)


def test_benchmark_takes_every_gradient_at_the_starting_weights(tiny_sd3_path):
    # benchmarks/bench_gradient_noise.py: K batches through the trainer's own step, the optimizer
    # held still; the gradients differ (other prompts and seeds) and the weights never move
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_gradient_noise import batch_gradients

    measured = batch_gradients("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "data.train_batch_size=2",
                                                  "rollout.n=2", "actor.ppo_micro_batch_size=4"], batches=3)
    engine = measured["engine"]
    lora = list(engine.learner.params)
    assert measured["images"] == 4 and len(measured["grads"]) == 3
    assert all(g.numel() == sum(p.numel() for p in lora) for g in measured["grads"])
    assert all(float(g.abs().sum()) > 0 for g in measured["grads"])
    assert not torch.equal(measured["grads"][0], measured["grads"][1])
    # LoRA B starts at zero: still zero means no optimizer step happened
    lora_b = [p for name, p in engine.model.transformer.named_parameters() if "lora_B" in name]
    assert lora_b and all(not p.detach().any() for p in lora_b)
    assert engine.policy_version == 0
