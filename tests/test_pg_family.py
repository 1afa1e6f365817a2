"""Policy-gradient family: GRPO-Guard, Flow-DPPO, MixGRPO windows, timestep selection."""

import math
from types import SimpleNamespace

import pytest
import torch

from pixelrl.algos import get_loss
from pixelrl.sampling import sde_step
from pixelrl.sampling.windows import Window, choose_window, mixgrpo_window, trained_step_indices


def test_grpo_guard_hand_computed():
    step = {"log_prob": torch.tensor([0.02, -0.01]), "old_log_prob": torch.tensor([0.0, 0.0]),
            "advantages": torch.tensor([1.0, -1.0]),
            "mean": torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "old_mean": torch.tensor([[0.9, 1.1], [0.0, 0.2]]),
            "std_dev_t": torch.tensor([[0.5], [0.3]]), "sqrt_dt": torch.tensor([[0.4], [0.2]])}
    loss, metrics = get_loss("grpo_guard")(step, SimpleNamespace(clip_ratio=1e-3, adv_clip_max=5.0))
    # c = 0.4 * 0.3 = 0.12; bias = [0.01, 0.02] / (2 * 0.0144) = [0.347222, 0.694444]
    # log_ratio = ([0.02, -0.01] + bias) * 0.12 = [0.044067, 0.082133]
    # clipped: sample 1 max(-1.045052, -1.001) = -1.001; sample 2 max(1.085600, 1.001) = 1.085600
    # loss = mean / mean(sqrt_dt)^2 = (-1.001 + 1.085600) / 2 / 0.09
    assert metrics["guard_bias"].item() == pytest.approx((0.347222 + 0.694444) / 2, abs=1e-5)
    assert loss.item() == pytest.approx((-1.001 + math.exp(0.0821333)) / 2 / 0.09, abs=1e-4)


def test_grpo_guard_log_ratio_has_zero_mean_drift():
    """Sampling x_next from the old step and scoring it under a moved mean: the plain log-ratio
    drifts by -bias on average; GRPO-Guard's corrected one averages to zero."""
    torch.manual_seed(0)
    n, dims = 4000, 16
    x, v = torch.zeros(n, dims), torch.zeros(n, dims)
    old = sde_step(x, v, 0.6, 0.5, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    moved = sde_step(x, v + 0.05, 0.6, 0.5, noise_level=0.7, prev_sample=old.prev_sample)
    c = old.std_dev_t.mean() * old.sqrt_dt.mean()
    bias = ((moved.mean - old.mean) ** 2).mean(dim=1) / (2 * c**2)
    plain = moved.log_prob - old.log_prob
    corrected = plain + bias
    assert plain.mean().item() == pytest.approx(-bias.mean().item(), rel=0.1)
    assert abs(corrected.mean().item()) < 0.1 * bias.mean().item()
    # and with an unchanged mean the corrected log-ratio is exactly zero
    same = sde_step(x, v, 0.6, 0.5, noise_level=0.7, prev_sample=old.prev_sample)
    step = {"log_prob": same.log_prob, "old_log_prob": old.log_prob, "advantages": torch.ones(n),
            "mean": same.mean, "old_mean": old.mean, "std_dev_t": old.std_dev_t, "sqrt_dt": old.sqrt_dt}
    _, metrics = get_loss("grpo_guard")(step, SimpleNamespace(clip_ratio=1e-4, adv_clip_max=5.0))
    assert metrics["ratio_mean"].item() == 1.0 and metrics["guard_bias"].item() == 0.0


def test_flow_dppo_masks_exactly_the_stated_samples():
    # D = [0.5, 0, 0.5, 0.5]; tau 0.1
    # 1: D >= tau, ratio > 1, A > 0 -> dropped     2: D = 0 -> kept
    # 3: D >= tau, ratio > 1, A < 0 -> kept (moving against its push)
    # 4: D >= tau, ratio < 1, A < 0 -> dropped
    step = {"log_prob": torch.tensor([0.1, -0.1, 0.1, -0.1]), "old_log_prob": torch.zeros(4),
            "advantages": torch.tensor([1.0, 1.0, -1.0, -1.0]),
            "mean": torch.tensor([[1.0], [0.0], [1.0], [1.0]]), "old_mean": torch.zeros(4, 1),
            "noise_std": torch.ones(4, 1)}
    loss, metrics = get_loss("flow_dppo")(step, SimpleNamespace(clip_ratio=1e-4, adv_clip_max=5.0, dppo_tau=0.1))
    expected = (0.0 - math.exp(-0.1) + math.exp(0.1) + 0.0) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["dppo_masked_frac"].item() == 0.5
    assert metrics["dppo_divergence"].item() == pytest.approx(0.375)


def test_mixgrpo_progressive_window_reproduces_its_schedule():
    # N = 10, W = 3: cap = 5; stride 2, 3 steps per group
    starts = [mixgrpo_window(10, 3, s, stride=2, iters_per_group=3).start for s in range(1, 16)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 5, 5, 5, 5, 5, 5]
    rolled = [mixgrpo_window(10, 3, s, stride=2, iters_per_group=3, rollback=True).start for s in range(1, 16)]
    assert rolled == [0, 0, 0, 2, 2, 2, 4, 4, 4, 0, 0, 0, 2, 2, 2]  # 6 % 6 = 0, 8 % 6 = 2
    assert mixgrpo_window(10, 3, 4, stride=2, iters_per_group=3) == Window(2, 5)


def test_mixgrpo_random_window_is_seeded_by_window_seed_plus_step():
    draws = [mixgrpo_window(10, 2, s, schedule="random", window_seed=5).start for s in range(1, 50)]
    assert draws == [mixgrpo_window(10, 2, s, schedule="random", window_seed=5).start for s in range(1, 50)]
    assert set(draws) == set(range(0, 7))  # cap = 10 - 2 - 2
    gen = torch.Generator().manual_seed(5 + 3)
    assert draws[2] == int(torch.randint(0, 7, (1,), generator=gen))
    assert choose_window(10, 2, None, 0, schedule="mixgrpo_random", global_step=3, window_seed=5).start == draws[2]


def test_trained_step_indices_in_order_and_permuted():
    # Flow-GRPO timestep_fraction: int(10 * 0.5) = 5 first window steps for everyone
    idx = trained_step_indices(9, 3, num_steps=10, fraction=0.5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 3
    perm = trained_step_indices(9, 4, num_steps=10, fraction=0.5, permute=True, seed=1)
    assert perm.shape == (4, 5) and all(len(set(row)) == 5 for row in perm.tolist())
    assert not all(row == perm[0].tolist() for row in perm.tolist())
    assert torch.equal(perm, trained_step_indices(9, 4, num_steps=10, fraction=0.5, permute=True, seed=1))
    assert trained_step_indices(2, 1, num_steps=10, fraction=1.0).tolist() == [[0, 1]]  # capped at W


def test_rollout_correction_weights_truncate_reject_and_report():
    from pixelrl.algos.rollout_correction import rollout_correction_weights

    old = torch.tensor([[0.0, math.log(3.0)], [math.log(0.5), 0.0], [0.0, 0.0]])
    rollout = torch.zeros(3, 2)
    weights, metrics = rollout_correction_weights(old, rollout, threshold=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0], [0.5, 1.0], [1.0, 1.0]]))
    assert metrics["rollout_corr/truncated_frac"] == pytest.approx(1 / 6)
    assert metrics["rollout_corr/logp_abs_diff_max"] == pytest.approx(math.log(3.0))
    assert metrics["rollout_corr/logp_abs_diff_step1"] == pytest.approx(math.log(3.0) / 3)
    # rejection works on the untruncated weight: sample 0 (3.0 > 2.5) and sample 1 (0.5 < 0.6)
    weights, metrics = rollout_correction_weights(old, rollout, threshold=2.0, lower=0.6, upper=2.5)
    assert torch.equal(weights[:2], torch.zeros(2, 2)) and torch.equal(weights[2], torch.ones(2))
    assert metrics["rollout_corr/rejected_frac"] == pytest.approx(2 / 3)


def test_multi_reward_sum_of_advantages():
    from pixelrl.core.config import PixelRLConfig
    from pixelrl.trainers.step import aggregate_advantages

    cfg = PixelRLConfig()
    cfg.reward.functions = [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}]
    cfg.algorithm.global_std = False
    scores = {"a": torch.tensor([0.0, 2.0, 1.0, 1.0]), "b": torch.tensor([10.0, 10.0, 0.0, 4.0])}
    scores["overall"] = scores["a"] + 0.5 * scores["b"]
    uids = ["x", "x", "y", "y"]
    summed = aggregate_advantages(scores, uids, cfg)
    # overall = [5, 7, 1, 3]: each group is (-1, +1) / (1 + 1e-4)
    assert torch.allclose(summed, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / 1.0001, atol=1e-6)
    cfg.algorithm.reward_aggregation = "sum_advantages"
    per = aggregate_advantages(scores, uids, cfg)
    # a: group x (0, 2) -> -+1 / 1.0001, group y has zero std -> 0
    # b: group x has zero std -> 0, group y (0, 4) -> -+2 / 2.0001;  A = 1 * A_a + 0.5 * A_b
    expected = torch.tensor([-1 / 1.0001, 1 / 1.0001, -0.5 * 2 / 2.0001, 0.5 * 2 / 2.0001])
    assert torch.allclose(per, expected, atol=1e-6)


def test_shared_initial_noise_per_group(make_engine, tiny_pixel_path):
    from pixelrl.trainers.step import expand_prompts

    engine, cfg = make_engine(tiny_pixel_path, rollout__same_noise_per_group=True)
    samples = expand_prompts(["a cat", "a dog"], [{}, {}], 4, seed=3)
    noise_seeds = [s - (i % 4) for i, s in enumerate(samples["seeds"])]
    batch = engine.rollout(samples["prompts"], samples["seeds"], noise_seeds=noise_seeds)
    first = batch["latents"][:, 0]  # x at window start 0 = the initial noise
    assert all(torch.equal(first[0], first[i]) for i in range(4)) and not torch.equal(first[0], first[4])
    assert not torch.equal(batch["latents"][0, 1], batch["latents"][1, 1])  # SDE noise still differs


TINY_METHODS = ["flow_grpo_fast_tiny", "cps_tiny", "mixgrpo_tiny", "dance_grpo_tiny", "grpo_guard_tiny",
                "flow_dppo_tiny", "decoupled_tiny"]


@pytest.mark.parametrize("config", TINY_METHODS)
def test_each_method_runs_two_steps_through_the_trainer_and_its_checkpoint_reloads(config, tmp_path,
                                                                                   tiny_pixel_path):
    from conftest import read_metrics
    from pixelrl.cli import main

    common = ["--config-name", config, f"model.path={tiny_pixel_path}", f"trainer.default_local_dir={tmp_path}",
              "trainer.backend=local", "trainer.logger=[jsonl]", "rollout.num_steps=6"]
    assert main(["train", *common, "trainer.total_training_steps=2"]) == 0
    run = tmp_path / "pixelrl" / config
    metrics = read_metrics(run)
    for m in metrics:
        for key in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "actor/ratio_mean"):
            assert math.isfinite(m[key]), (key, m[key])
    if config == "decoupled_tiny":
        assert "rollout_corr/logp_abs_diff_max" in metrics[0] and metrics[0]["rollout_corr/logp_abs_diff_max"] < 1e-3
    if config == "mixgrpo_tiny":
        assert [m["training/window_start"] for m in metrics] == [0, 1]
    assert main(["train", *common, "trainer.total_training_steps=3"]) == 0  # resumes from step 2
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
