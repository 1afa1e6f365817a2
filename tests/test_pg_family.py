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
    n, dims = 4000, 16
    x, v = torch.zeros(n, dims), torch.zeros(n, dims)
    old = sde_step(x, v, 0.6, 0.5, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    moved = sde_step(x, v + 0.05, 0.6, 0.5, noise_level=0.7, prev_sample=old.prev_sample)
    step = {"log_prob": moved.log_prob, "old_log_prob": old.log_prob, "advantages": torch.ones(n),
            "mean": moved.mean, "old_mean": old.mean, "std_dev_t": old.std_dev_t, "sqrt_dt": old.sqrt_dt}
    _, metrics = get_loss("grpo_guard")(step, SimpleNamespace(clip_ratio=1.0, adv_clip_max=5.0))
    bias = metrics["guard_bias"].item()
    plain = (moved.log_prob - old.log_prob).mean().item()
    assert bias > 0 and plain == pytest.approx(-bias, rel=0.1)
    # the loss's ratio is exp((plain + bias) * c): its mean log stays near 0, far below the drift
    c = (old.std_dev_t.mean() * old.sqrt_dt.mean()).item()
    assert abs(math.log(metrics["ratio_mean"].item())) < 0.1 * bias * c
    # and with an unchanged mean the corrected log-ratio is exactly zero
    same = sde_step(x, v, 0.6, 0.5, noise_level=0.7, prev_sample=old.prev_sample)
    step.update(log_prob=same.log_prob, mean=same.mean)
    _, metrics = get_loss("grpo_guard")(step, SimpleNamespace(clip_ratio=1e-4, adv_clip_max=5.0))
    assert metrics["ratio_mean"].item() == 1.0 and metrics["guard_bias"].item() == 0.0


def test_flow_dppo_masks_exactly_the_stated_samples_and_uses_the_raw_advantage():
    # D = [0.5, 0, 0.5, 0.5]; tau 0.1
    # 1: D >= tau, ratio > 1, A > 0 -> dropped (positive)     2: D = 0 -> kept
    # 3: D >= tau, ratio > 1, A < 0 -> kept (moving against its push)
    # 4: D >= tau, ratio < 1, A < 0 -> dropped (negative)
    # A = 10 on sample 2 is used raw: Flow-DPPO has no advantage clamp.
    step = {"log_prob": torch.tensor([0.1, -0.1, 0.1, -0.1]), "old_log_prob": torch.zeros(4),
            "advantages": torch.tensor([1.0, 10.0, -1.0, -1.0]),
            "mean": torch.tensor([[1.0], [0.0], [1.0], [1.0]]), "old_mean": torch.zeros(4, 1),
            "noise_std": torch.ones(4, 1)}
    loss, metrics = get_loss("flow_dppo")(step, SimpleNamespace(clip_ratio=1e-4, adv_clip_max=5.0, tau=0.1))
    expected = (0.0 - 10 * math.exp(-0.1) + math.exp(0.1) + 0.0) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["dppo_masked_frac"].item() == 0.5
    assert metrics["dppo_masked_frac_pos"].item() == 0.25 and metrics["dppo_masked_frac_neg"].item() == 0.25
    assert metrics["dppo_divergence"].item() == pytest.approx(0.375)
    assert "clipfrac" not in metrics  # there is no clip to report


def test_flow_dppo_default_threshold_is_the_reference_one():
    from pixelrl.algos.config import DiffusionLossConfig

    options = get_loss("flow_dppo").bind(DiffusionLossConfig(name="flow_dppo"))
    assert options.tau == 1e-5
    # a divergence of 2e-6 (what one update moves a step by) is below it: nothing masked;
    # a divergence of 2e-5 is above it: the sample pushing further is masked
    for divergence, masked in ((2e-6, 0.0), (2e-5, 1.0)):
        step = {"log_prob": torch.tensor([0.01]), "old_log_prob": torch.zeros(1), "advantages": torch.ones(1),
                "mean": torch.tensor([[math.sqrt(2 * divergence)]]), "old_mean": torch.zeros(1, 1),
                "noise_std": torch.ones(1, 1)}
        _, metrics = get_loss("flow_dppo")(step, options)
        assert metrics["dppo_masked_frac"].item() == masked


def test_mixgrpo_progressive_window_shrinks_at_the_tail_and_rolls_back_as_the_reference():
    # Official recipe: N = 25, W = 4, moved by 1 every step here; indices live in [0, 23)
    windows = [mixgrpo_window(25, 4, s, stride=1, iters_per_group=1, rollback=True) for s in range(1, 26)]
    assert windows[0] == Window(0, 4) and windows[18] == Window(18, 22)
    assert windows[19:23] == [Window(19, 23), Window(20, 23), Window(21, 23), Window(22, 23)]
    assert windows[23] == Window(0, 4)  # start would pass 22: roll back
    held = [mixgrpo_window(25, 4, s, stride=1, iters_per_group=1) for s in (23, 24, 40)]
    assert held == [Window(22, 23)] * 3  # without roll-back it stays on the last trainable index
    # N = 10, W = 3, stride 2, moved every 3 steps: starts 0, 2, 4, 6, then 7 (held) or 0 (rolled back)
    starts = [mixgrpo_window(10, 3, s, stride=2, iters_per_group=3).start for s in range(1, 16)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 7, 7, 7]
    rolled = [mixgrpo_window(10, 3, s, stride=2, iters_per_group=3, rollback=True).start for s in range(1, 16)]
    assert rolled == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 0, 0, 0]
    assert mixgrpo_window(10, 3, 10, stride=2, iters_per_group=3) == Window(6, 8)  # shrunk to 2


def test_mixgrpo_random_window_is_seeded_by_its_seed_plus_step():
    draws = [mixgrpo_window(10, 2, s, schedule="random", seed=5).start for s in range(1, 50)]
    assert draws == [mixgrpo_window(10, 2, s, schedule="random", seed=5).start for s in range(1, 50)]
    assert set(draws) == set(range(0, 7))  # start in [0, N - 2 - W]
    # the draw depends on seed + step only, and the window always has W steps
    assert mixgrpo_window(10, 2, 3, schedule="random", seed=5) == mixgrpo_window(10, 2, 4, schedule="random",
                                                                                         seed=4)
    assert choose_window(10, 2, None, 0, schedule="mixgrpo_random", global_step=3, params={"seed": 5}).start == draws[2]


def test_trained_step_indices_in_order_and_permuted():
    # Flow-GRPO timestep_fraction: int(10 * 0.5) = 5 first window steps for everyone
    idx = trained_step_indices(9, 3, num_steps=10, fraction=0.5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 3
    # DanceGRPO: int((N - 1) * fraction) = int(9 * 0.5) = 4 of a per-sample permutation of the 9 steps
    perm = trained_step_indices(9, 4, num_steps=10, fraction=0.5, permute=True, seed=1)
    assert perm.shape == (4, 4) and all(len(set(row)) == 4 for row in perm.tolist())
    assert not all(row == perm[0].tolist() for row in perm.tolist())
    assert torch.equal(perm, trained_step_indices(9, 4, num_steps=10, fraction=0.5, permute=True, seed=1))
    assert trained_step_indices(2, 1, num_steps=10, fraction=1.0).tolist() == [[0, 1]]  # capped at W


def _criteria(rollout_rs, threshold=None, lower=None, upper=None):
    from pixelrl.algos.rollout_correction import rejection_criteria

    return rejection_criteria(rollout_rs, threshold, lower, upper)


def test_rollout_correction_weights_truncate_reject_and_report():
    from pixelrl.algos.rollout_correction import rollout_correction

    old = torch.tensor([[0.0, math.log(3.0)], [math.log(0.5), 0.0], [0.0, 0.0]])
    rollout = torch.zeros(3, 2)
    weights, keep, metrics = rollout_correction(old, rollout, is_threshold=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0], [0.5, 1.0], [1.0, 1.0]])) and bool(keep.all())
    assert metrics["rollout_corr/truncated_frac"] == pytest.approx(1 / 6)
    assert metrics["rollout_corr/logp_abs_diff_max"] == pytest.approx(math.log(3.0))
    assert metrics["rollout_corr/logp_abs_diff_step1"] == pytest.approx(math.log(3.0) / 3)
    # keyed by the schedule position of each column, not by the column: windows differ per sample
    steps = torch.tensor([[3, 4], [3, 4], [4, 5]])
    _, _, metrics = rollout_correction(old, rollout, step_indices=steps)
    assert metrics["rollout_corr/logp_abs_diff_step3"] == pytest.approx(math.log(2.0) / 2)
    assert metrics["rollout_corr/logp_abs_diff_step4"] == pytest.approx(math.log(3.0) / 3)
    assert metrics["rollout_corr/logp_abs_diff_step5"] == 0.0 and "rollout_corr/logp_abs_diff_step0" not in metrics
    # any_step (the older rule) rejects whole samples: sample 0 (3.0 > 2.5) and sample 1 (0.5 < 0.6); the
    # weights stay as they are, the step mask carries the rejection
    weights, keep, metrics = rollout_correction(old, rollout, is_threshold=2.0,
                                                criteria=_criteria("any_step", lower=0.6, upper=2.5))
    assert keep.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]] and torch.equal(weights[2], torch.ones(2))
    assert metrics["rollout_corr/rejected_sample_frac"] == pytest.approx(2 / 3)
    # IcePop (`lower_upper`): weights outside [0.6, 2.5] are zeroed, not truncated
    weights, _, metrics = rollout_correction(old, rollout, is_threshold="0.6_2.5")
    assert torch.allclose(weights, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    assert metrics["rollout_corr/is_oob_frac"] == pytest.approx(2 / 6)
    # batch normalisation to mean 1 (verl's rollout_is_batch_normalize)
    weights, _, metrics = rollout_correction(old, rollout, is_threshold=2.0, is_batch_normalize=True)
    assert float(weights.mean()) == pytest.approx(1.0) and metrics["rollout_corr/is_batch_norm_factor"] == \
        pytest.approx(6.5 / 6)


def test_older_rejection_levels_by_hand():
    """The older names on [B, W] sample-steps with ratio bounds [0.5, 2]: token drops only the
    steps outside, sequence judges the product of a sample's ratios, geometric their geometric
    mean; the log-ratio is clamped to +-20 before exp (verl's SAFETY_BOUND)."""
    from pixelrl.algos.rollout_correction import rollout_correction

    log = math.log
    # sample 0: ratios (3, 1/2) -> product 1.5, geometric mean sqrt(1.5); sample 1: (1.5, 1.5) ->
    # product 2.25, geometric 1.5; sample 2: (1, 1)
    old = torch.tensor([[log(3.0), log(0.5)], [log(1.5), log(1.5)], [0.0, 0.0]])
    rollout = torch.zeros(3, 2)

    def kept(level):
        _, keep, metrics = rollout_correction(old, rollout, is_threshold=10.0, criteria=_criteria(level, upper=2.0))
        return keep.int().tolist(), metrics

    token, metrics = kept("token")
    assert token == [[0, 1], [1, 1], [1, 1]]  # only the step with ratio 3 leaves [0.5, 2]
    assert metrics["rollout_corr/rejected_step_frac"] == pytest.approx(1 / 6)
    assert metrics["rollout_corr/rejected_sample_frac"] == pytest.approx(1 / 3)
    assert kept("sequence")[0] == [[1, 1], [0, 0], [1, 1]]  # 1.5 kept, 2.25 rejected
    assert kept("geometric")[0] == [[1, 1], [1, 1], [1, 1]]  # sqrt(1.5) and 1.5 inside
    assert kept("any_step")[0] == [[0, 0], [1, 1], [1, 1]]
    assert _criteria("token") == ()  # an older name without bounds rejects nothing, as before
    # sequence importance weights: the product, truncated
    weights, _, _ = rollout_correction(old, rollout, is_threshold=2.0, is_level="sequence")
    assert torch.allclose(weights, torch.tensor([[1.5, 1.5], [2.0, 2.0], [1.0, 1.0]]))
    # a log-ratio of 100 is clamped to 20 before exp: a finite weight
    far = torch.tensor([[100.0, 0.0]])
    weights, _, _ = rollout_correction(far, torch.zeros(1, 2), is_threshold=float("inf"), is_level="sequence")
    assert torch.allclose(weights, torch.full((1, 2), math.exp(20.0)))


def _verl_rejection_mask(log_ratio, options: str, thresholds: str):
    """verl's compute_rollout_rejection_mask (verl/trainer/ppo/rollout_corr_helper.py, 2026),
    transcribed for an all-valid response mask: k1 = -log r, k2 = (log r)^2 / 2, k3 = e^(log r) - 1
    - log r on the log-ratio clamped to +-20; k1 options keep log(lo) <= stat <= log(hi) with lo =
    1 / hi unless given as lo_hi; the rest keep stat <= hi; every listed option must pass."""
    lr = log_ratio.clamp(-20.0, 20.0)
    per_token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    names = options.split(",")
    specs = thresholds.split(",")
    specs = specs * len(names) if len(specs) == 1 else specs
    mask = torch.ones_like(lr)
    for name, spec in zip(names, specs):
        level, k = name.rsplit("_", 1)
        stat = per_token[k]
        if level == "seq_sum":
            stat = stat.sum(-1, keepdim=True).expand_as(lr)
        elif level == "seq_mean":
            stat = stat.mean(-1, keepdim=True).expand_as(lr)
        elif level == "seq_max":
            stat = stat.max(-1, keepdim=True).values.expand_as(lr)
        if k == "k1":
            lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
            keep = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            keep = stat <= float(spec)
        mask = mask * keep.float()
    return mask


@pytest.mark.parametrize("options, thresholds", [
    ("token_k1", "2.0"), ("token_k1", "0.7_1.6"), ("token_k2", "0.05"), ("token_k3", "0.05"),
    ("seq_sum_k1", "2.0"), ("seq_sum_k2", "0.2"), ("seq_sum_k3", "0.2"), ("seq_mean_k1", "0.8_1.3"),
    ("seq_mean_k2", "0.05"), ("seq_mean_k3", "0.05"), ("seq_max_k2", "0.1"), ("seq_max_k3", "0.1"),
    ("token_k1,seq_mean_k3", "1.5,0.03"), ("seq_sum_k1,seq_max_k2", "0.5_3.0,0.2"),
])
def test_rejection_criteria_equal_verls_under_their_current_names(options, thresholds):
    from pixelrl.algos.rollout_correction import rollout_correction

    old = 0.4 * torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    old[3, 2] = 40.0  # past the safety bound
    _, keep, metrics = rollout_correction(old, torch.zeros(64, 5), criteria=_criteria(options, thresholds))
    expected = _verl_rejection_mask(old, options, thresholds)
    assert torch.equal(keep, expected)
    assert 0 < float(expected.mean()) < 1  # the bounds bite, and not everywhere
    assert metrics["rollout_corr/rejected_step_frac"] == pytest.approx(1 - float(expected.mean()))


def test_rejected_steps_leave_the_loss_mean_and_the_kl_as_verls_response_mask(make_engine, tiny_pixel_path):
    """verl takes a rejected step out of the response mask, so the loss is the mean over the kept
    steps and so is the KL. Rejecting step 1 of every sample must therefore train exactly as
    training step 0 alone: the same loss and the same gradient (where weighting them 0 but keeping
    them in the denominator divides both by the window's 5 steps)."""

    from pixelrl.models.lora import adapter_params

    engine, cfg = make_engine(tiny_pixel_path, diffusion_loss__kl_coef=0.5)
    with torch.no_grad():  # the policy away from the reference, so that the KL term has a gradient
        for p in adapter_params(engine.model.transformer, "default").values():
            p.add_(0.05)
    batch = engine.rollout(["a red circle", "a cat"] * 2, [1, 2, 3, 4])
    batch.update(engine.score(batch, "reference"))
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def one_update(train):
        grads, losses = [], []
        keep = engine.learner.step

        def capture(loss_value):
            losses.append(loss_value)
            grads.append(torch.cat([p.grad.flatten() for p in engine.learner.params if p.grad is not None]).clone())
            raise StopIteration  # no optimizer step: both updates start from the same weights

        engine.learner.step = capture
        try:
            engine.update(train)
        except StopIteration:
            pass
        finally:
            engine.learner.step = keep
        return losses[0], grads[0]

    masked = batch.select(range(len(batch)))
    masked["step_mask"] = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]] * 4)  # the full window: 5 steps
    only_first = batch.select(range(len(batch)))
    only_first["train_step_index"] = torch.zeros(4, 1, dtype=torch.long)
    loss_masked, grad_masked = one_update(masked)
    loss_first, grad_first = one_update(only_first)
    assert loss_masked == pytest.approx(loss_first, rel=1e-5)
    # float32 sums in another order (5 steps with 4 zero-weighted against 1): on an AMD EPYC the
    # largest difference is 1e-6 of the largest gradient entry; the divisor 5 this test guards
    # against would make every entry differ by 80%
    assert torch.allclose(grad_masked, grad_first, rtol=1e-4, atol=1e-5 * float(grad_first.abs().max()))
    assert float(grad_first.abs().max()) > 0


def test_multi_reward_sum_of_advantages_and_gdpo():
    from pixelrl.config.sections import PixelRLConfig
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
    cfg.algorithm.reward_aggregation = "gdpo"  # Flow-Factory's: no eps, then standardised over the batch
    gdpo = aggregate_advantages(scores, uids, cfg)
    # a: x -> (-1, +1), y (std 0, floored at 1e-6) -> (0, 0); b: x -> (0, 0), y (0, 4) -> (-1, +1) x 0.5;
    # sum (-1, 1, -0.5, 0.5): mean 0, population std sqrt(2.5 / 4) = 0.790569
    assert torch.allclose(gdpo, torch.tensor([-1.0, 1.0, -0.5, 0.5]) / 0.625 ** 0.5, atol=1e-6)


def test_shared_initial_noise_per_group_is_independent_of_the_sde_noise(make_engine, tiny_pixel_path):
    from pixelrl.trainers.step import expand_prompts, group_noise_seeds

    # grpo_guard makes the rollout store each step's mean, so the SDE noise is x_next - mean
    engine, cfg = make_engine(tiny_pixel_path, rollout__same_noise_per_group=True, diffusion_loss__name="grpo_guard")
    samples = expand_prompts(["a cat", "a dog"], [{}, {}], 4, seed=3)
    batch = engine.rollout(samples["prompts"], samples["seeds"], noise_seeds=group_noise_seeds(samples["seeds"], 4))
    initial = batch["latents"][:, 0]  # x at window start 0 = the initial noise
    assert all(torch.equal(initial[0], initial[i]) for i in range(4)) and not torch.equal(initial[0], initial[4])
    first_sde_noise = batch["latents"][:, 1] - batch["old_means"][:, 0]
    cosine = torch.nn.functional.cosine_similarity(first_sde_noise.flatten(1), initial.flatten(1), dim=1)
    assert cosine.abs().max() < 0.1  # every image's first transition is a fresh draw (was 1.0 for image 0)
    assert not torch.equal(first_sde_noise[0], first_sde_noise[1])  # SDE noise differs within a group


# What identifies each method in its metrics and in the sampling settings its rollouts record.
TINY_METHODS = {
    "flow_grpo_fast_tiny": ({"actor/clipfrac"}, "sde"),
    "cps_tiny": ({"actor/clipfrac"}, "cps"),
    "mixgrpo_tiny": ({"actor/clipfrac"}, "sde"),
    "dance_grpo_tiny": ({"actor/clipfrac"}, "dance_sde"),
    "grpo_guard_tiny": ({"actor/guard_bias", "actor/clipfrac"}, "sde"),
    "flow_dppo_tiny": ({"actor/dppo_masked_frac_pos", "actor/dppo_divergence"}, "sde"),
    "decoupled_tiny": ({"rollout_corr/is_weight_mean", "rollout_corr/logp_abs_diff_max"}, "sde"),
}
OTHER_METHODS_KEYS = {"actor/guard_bias", "actor/dppo_masked_frac_pos", "rollout_corr/is_weight_mean"}


@pytest.mark.parametrize("config", sorted(TINY_METHODS))
def test_each_method_runs_as_itself_through_the_trainer_and_its_checkpoint_reloads(config, tmp_path,
                                                                                 tiny_pixel_path):
    import json

    from conftest import read_metrics
    from pixelrl.cli import main

    own_keys, sampler = TINY_METHODS[config]
    dumps = tmp_path / "rollouts"
    common = ["--config-name", config, f"model.path={tiny_pixel_path}", f"trainer.default_local_dir={tmp_path}",
              "trainer.backend=local", "trainer.logger=[jsonl]", "rollout.num_steps=6"]
    assert main(["train", *common, "trainer.total_training_steps=2", f"trainer.rollout_data_dir={dumps}"]) == 0
    run = tmp_path / "pixelrl" / config
    metrics = read_metrics(run)
    for m in metrics:
        for key in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "actor/ratio_mean", *own_keys):
            assert math.isfinite(m[key]), (key, m[key])
        assert not (OTHER_METHODS_KEYS - own_keys) & set(m)  # no other method's loss ran
    info = json.loads((dumps / "step_000001" / "info.json").read_text())
    assert info["sampling"]["sde_type"] == sampler
    if config == "decoupled_tiny":
        assert metrics[0]["rollout_corr/logp_abs_diff_max"] < 1e-3
    if config == "mixgrpo_tiny":
        assert [m["training/window_start"] for m in metrics] == [0, 1]
    if config == "flow_grpo_fast_tiny":
        assert [m["training/window_size"] for m in metrics] == [2, 2]
    assert main(["train", *common, "trainer.total_training_steps=3"]) == 0  # resumes from step 2
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_bound_specs_read_as_text_or_lists():
    """`lower_upper` text and [lower, upper] lists give the same bounds; a lone k1 bound is the
    upper one with lower 1 / upper; YAML's reading of 0.5_2 (the number 0.52) is refused, since a
    lone upper bound below 1 puts lower above upper."""
    from pixelrl.algos.rollout_correction import Criterion, importance_threshold
    from pixelrl.core.errors import ConfigError

    assert _criteria("token_k1", "0.5_2.0") == _criteria("token_k1", [0.5, 2.0]) == \
        (Criterion("token_k1", 2.0, 0.5),)
    assert _criteria("token_k1", 4.0) == (Criterion("token_k1", 4.0, 0.25),)
    assert _criteria("token_k1,seq_max_k2", ["0.5_2.0", 0.1]) == (Criterion("token_k1", 2.0, 0.5),
                                                                  Criterion("seq_max_k2", 0.1))
    assert importance_threshold("0.5_5.0") == importance_threshold([0.5, 5.0]) == (5.0, 0.5)
    assert importance_threshold(2.0) == (2.0, None)
    with pytest.raises(ConfigError, match="0.5_2.0"):
        _criteria("token_k1", 0.52)
