"""Proxy-ranked oversampling (`rollout.oversample`): the keep rules by hand, and the producer on a
tiny model: the kept seeds are the pool's best and worst, each kept sample is the training
sampler's own sample from that seed (bitwise), the pool and the regeneration start from one
initial noise, and advantages are the kept set's."""

import pytest
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.sampling.config import Oversample
from pixelrl.sampling.oversampling import kept_positions
from pixelrl.sampling.rollout import SamplingSettings
from pixelrl.sampling.windows import Window


def keep(values, k, rule, uids=None, seed=0):
    proxy = torch.tensor(values, dtype=torch.float32)
    return kept_positions(proxy, uids or ["g"] * len(values), k, rule, torch.Generator().manual_seed(seed))


def test_best_worst_keeps_the_top_half_and_the_bottom_half_in_pool_order():
    values = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4]
    assert keep(values, 4, "best_worst") == [0, 1, 5, 6]  # 0.9, 0.8 and 0.1, 0.2
    assert keep(values, 3, "best_worst") == [0, 1, 5]  # K // 2 = 1 best (0.9), K - K // 2 = 2 worst
    assert keep([1.0] * 4, 2, "best_worst") == [0, 3]  # ties: pool order decides, the ends distinct
    # per group, groups in order of appearance (a prompt's candidates need not be adjacent)
    assert keep([5, 1, 9, 2, 3, 7], 2, "best_worst", uids=["a", "b", "a", "b", "a", "b"]) == [2, 4, 1, 5]


def test_mean_deviation_and_extremes_random():
    # mean 3.25: deviations 3.25, 2.25, 1.25, 6.75
    assert keep([0.0, 1.0, 2.0, 10.0], 2, "mean_deviation") == [0, 3]
    values = [0.3, 0.9, 0.5, 0.1, 0.6, 0.4]
    for seed in range(5):
        chosen = keep(values, 3, "extremes_random", seed=seed)
        assert 1 in chosen and 3 in chosen and len(set(chosen)) == 3
    draws = {tuple(keep(values, 3, "random", seed=s)) for s in range(8)}
    assert len(draws) > 1 and all(len(set(d)) == 3 for d in draws)
    assert keep(values, 3, "random", seed=3) == keep(values, 3, "random", seed=3)


def test_a_group_smaller_than_the_kept_count_is_an_error():
    with pytest.raises(ValueError, match="cannot keep 3"):
        keep([0.1, 0.2], 3, "best_worst")


class Brightness:
    """A reward that is a fixed function of the image, so a pool ranks exactly."""

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata, groups=None, **kwargs):
        self.calls.append(len(images))
        score = images.float().mean(dim=(1, 2, 3)) / 255
        return {"overall": score, "brightness": score}


def oversampled_engine(make_engine, path, **oversample):
    return make_engine(path, rollout__n=2, rollout__oversample=Oversample(factor=3, **oversample))


def test_kept_samples_are_the_pool_extremes_sampled_again_exactly(make_engine, tiny_pixel_path):
    from pixelrl.trainers.step import compute_advantages, make_rollout, plan_rollout

    engine, cfg = oversampled_engine(make_engine, tiny_pixel_path, num_steps=3)
    reward = Brightness()
    rollout = make_rollout(engine, reward, ["a cat", "a dog"], [{}, {}], 1, cfg, uids=["u0", "u1"])
    batch = rollout.batch
    # the pool as the producer samples it: 3 x 2 candidates per prompt, 3 deterministic DPM++ steps
    pool_request, window = plan_rollout(["a cat", "a dog"], [{}, {}], 1, cfg, uids=["u0", "u1"])
    assert len(pool_request) == 12 and window.size > 0
    cheap = SamplingSettings(noise_level=0.0, guidance_scale=cfg.rollout.guidance_scale, solver="dpm2")
    pool = engine.rollout(pool_request["prompts"], pool_request["seeds"], window=Window(0, 0), settings=cheap,
                          num_steps=3)
    proxy = reward(pool["images"], pool["prompts"], [{}] * 12)["overall"]
    expected = [pool_request["seeds"][g * 6 + int(proxy[g * 6:(g + 1) * 6].argmax())] for g in range(2)]
    expected += [pool_request["seeds"][g * 6 + int(proxy[g * 6:(g + 1) * 6].argmin())] for g in range(2)]
    assert sorted(batch["seeds"]) == sorted(expected)
    assert batch["uids"] == ["u0", "u0", "u1", "u1"]
    # each kept sample is the training sampler's own (SDE window and all), bitwise
    direct = engine.rollout(batch["prompts"], batch["seeds"], window=rollout.window)
    for key in ("images", "latents", "log_probs", "x0"):
        assert torch.equal(batch[key], direct[key]), key
    # rewards are the exact samples', advantages the kept set's
    assert torch.equal(batch["rewards"], reward(direct["images"], direct["prompts"], [{}] * 4)["overall"])
    assert torch.equal(batch["advantages"], compute_advantages(batch["rewards"], batch["uids"], cfg.algorithm))
    assert reward.calls == [12, 4, 12, 4]  # the producer's pool and kept calls, then this test's


def test_the_pool_and_the_regeneration_start_from_one_initial_noise(make_engine, tiny_pixel_path):
    """With an ODE training sampler and a pool on the same solver and grid, sampling again from a
    kept seed reproduces the pool's image bitwise: the initial noise is the seed's, in both."""
    from pixelrl.trainers.step import make_rollout, plan_rollout

    # one sample per forward in both, so no batch-size-dependent kernel choice enters the comparison
    engine, cfg = make_engine(tiny_pixel_path, rollout__n=2, rollout__noise_level=0.0, rollout__micro_batch_size=1,
                              rollout__oversample=Oversample(factor=2, solver="euler"))
    rollout = make_rollout(engine, Brightness(), ["a cat"], [{}], 3, cfg, uids=["u"])
    request, _ = plan_rollout(["a cat"], [{}], 3, cfg, uids=["u"])
    pool = engine.rollout(request["prompts"], request["seeds"], window=Window(0, 0),
                          settings=SamplingSettings(noise_level=0.0, guidance_scale=cfg.rollout.guidance_scale))
    rows = [request["seeds"].index(s) for s in rollout.batch["seeds"]]
    assert torch.equal(rollout.batch["images"], pool["images"][rows])
    assert rollout.batch.info["producer_metrics"]["oversample/proxy_exact_corr"] == pytest.approx(1.0)


def test_without_regeneration_the_kept_pool_samples_are_trained(make_engine, tiny_pixel_path):
    from pixelrl.trainers.step import make_rollout

    engine, cfg = make_engine(tiny_pixel_path, rollout__n=2, rollout__noise_level=0.0, rollout__micro_batch_size=1,
                              rollout__oversample=Oversample(factor=2, num_steps=2, regenerate=False))
    calls = []
    sample = engine.rollout
    engine.rollout = lambda *args, **kwargs: calls.append(kwargs.get("num_steps")) or sample(*args, **kwargs)
    reward = Brightness()
    rollout = make_rollout(engine, reward, ["a cat"], [{}], 1, cfg, uids=["u"])
    assert calls == [2] and reward.calls == [4]  # the pool only, scored once
    kept = engine.rollout(rollout.batch["prompts"], rollout.batch["seeds"], window=Window(0, 0), num_steps=2,
                          settings=SamplingSettings(noise_level=0.0, guidance_scale=1.0, solver="dpm2"))
    assert torch.equal(rollout.batch["x0"], kept["x0"])
    assert "timing_s/gen" not in rollout.seconds and rollout.seconds["gen_pool"] > 0


def test_the_config_refuses_what_the_pool_cannot_serve():
    from pixelrl.sampling.config import RolloutConfig

    with pytest.raises(ConfigError, match="rollout.oversample.factor.*same_noise_per_group"):
        RolloutConfig(same_noise_per_group=True, oversample=Oversample(factor=2)).check()
    with pytest.raises(ConfigError, match="rollout.oversample.factor.*n_workers"):
        RolloutConfig(n_workers=1, oversample=Oversample(factor=2)).check()
    with pytest.raises(ConfigError, match="rollout.oversample.solver"):
        RolloutConfig(oversample=Oversample(factor=2, solver="sa_solver")).check()
    with pytest.raises(ConfigError, match="rollout.oversample.keep"):
        RolloutConfig(oversample=Oversample(factor=2, keep="median")).check()
    RolloutConfig(same_noise_per_group=True).check()  # factor 1: no pool, nothing to refuse


def test_the_planner_counts_the_pool():
    from pixelrl.config import load_config
    from pixelrl.config.plan import step_work

    plain = step_work(load_config("shapes_nft", []), 1)
    pooled = step_work(load_config("shapes_nft", ["rollout.oversample.factor=4", "rollout.oversample.num_steps=6"]), 1)
    assert (plain.pool_images, pooled.pool_images, pooled.pool_steps) == (0, 4 * plain.sampled_images, 6)
    assert pooled.sampled_images == plain.sampled_images  # the kept samples are sampled again
    kept_as_sampled = step_work(load_config("shapes_nft", ["rollout.oversample.factor=4",
                                                           "rollout.oversample.regenerate=false"]), 1)
    assert kept_as_sampled.sampled_images == 0 and kept_as_sampled.pool_steps == 10


@pytest.mark.slow  # ~30 s; the producer's own tests above run the same rank_pool in-process
def test_a_training_run_with_a_pool_logs_what_the_pool_showed(tmp_path, tiny_pixel_path):
    from conftest import read_metrics, train_cli

    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.total_training_steps=2", "trainer.backend=local",
                          "trainer.n_workers=1", "rollout.oversample.factor=2", "rollout.oversample.num_steps=2")
    assert code == 0
    rows = read_metrics(run)
    assert len(rows) == 2
    for row in rows:  # the pool's phases and statistics beside the step's own
        assert row["timing_s/gen_pool"] > 0 and row["timing_s/reward_pool"] > 0 and row["timing_s/gen"] > 0
        assert {"oversample/pool_reward_mean", "oversample/pool_group_std", "oversample/kept_group_std",
                "oversample/kept_reward_gap"} <= set(row)


def test_the_paper_config_ranks_96_candidates_and_trains_24_per_prompt():
    """Sol-RL's SD3 setting: 96 seeds a prompt at 6 DPM++ steps, the 12 best and 12 worst sampled
    again with the 10-step DPM++ rollout sampler, DiffusionNFT on them; the planner counts both."""
    from conftest import paper_config
    from pixelrl.config.plan import step_work

    cfg = paper_config("sol_rl_sd35")
    r, over = cfg.rollout, cfg.rollout.oversample
    assert (r.n * over.factor, over.num_steps, over.solver, over.keep, over.regenerate) == (96, 6, "dpm2",
                                                                                          "best_worst", True)
    assert (r.n, r.num_steps, r.solver, r.noise_level, r.guidance_scale) == (24, 10, "dpm2", 0.0, 1.0)
    assert cfg.diffusion_loss.name == "diffusion_nft" and cfg.data.train_batch_size == 48
    work = step_work(cfg, 8)
    assert (work.pool_images, work.sampled_images) == (48 * 96 // 8, 48 * 24 // 8)
