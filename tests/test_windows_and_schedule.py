import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from pixelrl.core.errors import ConfigError
from pixelrl.sampling import Window, choose_window, full_window, random_window, sigmas_from_scheduler


def test_full_window_excludes_the_last_step():
    assert full_window(10) == Window(0, 9)
    assert 8 in full_window(10) and 9 not in full_window(10)


def test_random_window_is_reproducible_from_its_seed_and_stays_in_range():
    starts = set()
    for seed in range(200):
        w = random_window(10, 2, (0, 6), seed)
        assert w == random_window(10, 2, (0, 6), seed)
        assert 0 <= w.start and w.end <= 6 and w.size == 2
        starts.add(w.start)
    # start = randint(r0, r1 - W) inclusive: every start 0..4 occurs
    assert starts == {0, 1, 2, 3, 4}


def test_choose_window_full_when_size_zero():
    assert choose_window(6, 0, None, 3) == Window(0, 5)


def test_window_errors_name_the_field():
    with pytest.raises(ConfigError, match="sde_window_range"):
        random_window(10, 2, (0, 10), 0)
    with pytest.raises(ConfigError, match="sde_window_size"):
        random_window(10, 5, (0, 3), 0)


def test_sigmas_come_from_the_scheduler_with_shift():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = sigmas_from_scheduler(sched, 4)
    assert sigmas.shape == (5,) and sigmas[-1] == 0 and sigmas[0] == pytest.approx(1.0)
    # diffusers: a linear grid from sigma_max to sigma_min of the (already shifted) training
    # sigmas, then shifted again: s' = shift s / (1 + (shift - 1) s). sigma_min = shift(1/1000).
    sigma_min = 3 * 0.001 / (1 + 2 * 0.001)
    lin = torch.linspace(1.0, sigma_min, 4)
    expected = 3 * lin / (1 + 2 * lin)
    assert torch.allclose(sigmas[:-1], expected, atol=1e-5)
    assert getattr(sched, "num_inference_steps", None) is None  # the model's own scheduler is untouched


def test_dgpo_grid_is_dpm_solvers_flow_sigma_grid():
    """DGPO's reference samples with diffusers' DPMSolverMultistepScheduler, `use_flow_sigmas` and
    `flow_shift = 3` (train_sd3_dgpo.py): transcribed, sigma = 3 s / (1 + 2 s) on s = 1 -
    linspace(1, 1/1000, N + 1), reversed, its last value dropped and a final 0 appended. pixelrl's
    `dpm_flow` grid equals it and the scheduler's own, and an engine on it samples and trains there."""
    import numpy as np
    from diffusers import DPMSolverMultistepScheduler

    from pixelrl.sampling.schedule import dpm_flow_sigmas

    s = 1.0 - np.linspace(1, 1 / 1000, 11)
    transcribed = np.append(np.flip(3 * s / (1 + 2 * s))[:-1], 0.0)
    ours = dpm_flow_sigmas(10, 3.0)
    assert np.allclose(ours.numpy(), transcribed, atol=1e-7)
    assert abs(float(ours[0]) - 0.99967) < 1e-5 and abs(float(ours[9]) - 0.2498) < 1e-4 and float(ours[10]) == 0.0
    theirs = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    theirs.set_timesteps(14)
    assert torch.equal(dpm_flow_sigmas(14, 3.0), theirs.sigmas.float())


def test_an_engine_on_the_dpm_flow_grid_samples_and_trains_dgpos_timesteps_there(tiny_pixel_path):
    from conftest import tiny_config
    from pixelrl.core.batch import Batch
    from pixelrl.engine import PolicyEngine
    from pixelrl.sampling.schedule import dpm_flow_sigmas

    cfg = tiny_config(tiny_pixel_path, algorithm__trainer_type="forward_process", diffusion_loss__name="dgpo",
                      rollout__solver="dpm2", rollout__noise_level=0.0, rollout__sigma_schedule="dpm_flow",
                      diffusion_loss__params={"num_timesteps": 4, "max_timestep_index": 4})
    engine = PolicyEngine.from_config(cfg)
    shift = float(engine.model.scheduler.config.get("shift", 1.0))
    assert torch.equal(engine.sigmas, dpm_flow_sigmas(cfg.rollout.num_steps, shift))
    x0 = engine.rollout(["a red circle", "a cat"], [1, 2])["x0"]
    rows = Batch({"x0": x0, "advantages": torch.tensor([1.0, -1.0])}, {"prompts": ["a red circle", "a cat"],
                                                                       "uids": ["a", "b"]})
    engine.objective.context(rows)
    assert set(rows["fm_t"].flatten().tolist()) <= set(engine.sigmas[:5].tolist())
