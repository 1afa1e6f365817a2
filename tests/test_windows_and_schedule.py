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
