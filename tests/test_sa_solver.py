"""SA-Solver (AWM's sampler): each predictor and corrector update against diffusers'
`SASolverScheduler` in flow mode, the driver against a transcription of the reference's
`SASolver.sample` (PEC, orders 2/2), its accuracy and marginals on a Gaussian whose flow is
known, and its place in the rollout and the config."""

from __future__ import annotations

import math

import pytest
import torch

from pixelrl.sampling.sa_solver import SASolver, adams_update, awm_tau, sa_solver_grid


def _diffusers_scheduler(grid):
    from diffusers import SASolverScheduler

    sched = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                              algorithm_type="data_prediction", predictor_order=2, corrector_order=2)
    sched.sigmas = torch.tensor(grid, dtype=torch.float64)
    return sched


@pytest.mark.parametrize("tau", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("order", [1, 2])
def test_each_update_equals_diffusers_sasolver_scheduler(tau, order):
    gen = torch.Generator().manual_seed(0)
    grid = [0.999, 0.93, 0.81, 0.62, 0.4, 0.2, 0.0]
    x, noise = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    d = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(4)]  # data predictions at grid[0..3]
    k = 2  # the step from grid[2] to grid[3]
    sched = _diffusers_scheduler(grid)
    sched._step_index = k
    sched.model_outputs = [d[k - 1], d[k]]
    theirs = sched.stochastic_adams_bashforth_update(None, sample=x, noise=noise, order=order,
                                                     tau=torch.tensor(tau, dtype=torch.float64))
    ours = adams_update(x, [d[k], d[k - 1]][:order], [grid[k], grid[k - 1]][:order], grid[k], grid[k + 1], tau, noise,
                        corrector=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    # the corrector of the same step: the history ends with the prediction's own data prediction
    sched._step_index = k + 1
    theirs = sched.stochastic_adams_moulton_update(this_model_output=d[k + 1], last_sample=x, last_noise=noise,
                                                   this_sample=x, order=order,
                                                   tau=torch.tensor(tau, dtype=torch.float64))
    ours = adams_update(x, [d[k + 1], d[k]][:order], [grid[k + 1], grid[k]][:order], grid[k], grid[k + 1], tau,
                        noise, corrector=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def _reference_sample(x, velocity, tau_fn, grid, noises, p=2, c=2):
    """A transcription of the reference's `SASolver.sample` driver (PEC, first corrector off, the
    last step to 0 returning the data prediction, lower orders at the end), on the update pixelrl
    checks against diffusers above. `noises[s]` is the noise of the step into grid[s]."""
    def data(x_, t):
        return x_ - t * velocity(x_, t)

    steps = len(grid) - 1
    t_prev, models = [grid[0]], [data(x, grid[0])]
    for step in range(1, max(p, c - 1)):
        t, po, co = grid[step], min(p, step), min(c, step + 1)
        x_p = adams_update(x, models[::-1][:po], t_prev[::-1][:po], t_prev[-1], t, tau_fn(t), noises[step], False)
        models.append(data(x_p, t))
        if c > 0 and step != 1:
            x = adams_update(x, models[::-1][:co], (t_prev + [t])[::-1][:co], t_prev[-1], t, tau_fn(t), noises[step],
                             True)
        else:
            x = x_p
        t_prev.append(t)
    for step in range(max(p, c - 1), steps + 1):
        po, co = min(p, steps - step + 1), min(c, steps - step + 2)
        t = grid[step]
        if step == steps:
            x_p = models[-1]
        else:
            x_p = adams_update(x, models[::-1][:po], t_prev[::-1][:po], t_prev[-1], t, tau_fn(t), noises[step], False)
        if step < steps:
            models.append(data(x_p, t))
            x = adams_update(x, models[::-1][:co], (t_prev + [t])[::-1][:co], t_prev[-1], t, tau_fn(t), noises[step],
                             True)
        else:
            x = x_p
        t_prev.append(t)
        del models[0]
    return x


def _gaussian_velocity(scale):
    """The exact flow of data N(0, scale^2): x_t = (1 - t) x0 + t eps has std
    s(t) = sqrt((1 - t)^2 scale^2 + t^2), and the ODE moves x along s'(t) / s(t)."""
    def velocity(x, t):
        var = (1 - t) ** 2 * scale ** 2 + t ** 2
        return x * ((t - 1) * scale ** 2 + t) / var
    return velocity


@pytest.mark.parametrize("steps", [2, 3, 10, 14])
def test_the_driver_follows_the_references_sample_loop(steps):
    """Orders, the first corrector left out, the corrector reusing its predictor's noise, and the
    last step returning the data prediction: the same sample as the reference's driver."""
    from pixelrl.sampling.schedule import linspace_shift_sigmas

    velocity = _gaussian_velocity(0.5)
    grid = sa_solver_grid(linspace_shift_sigmas(steps, 3.0))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, dtype=torch.float64, generator=gen)
    noises = [torch.randn(64, dtype=torch.float64, generator=gen) for _ in range(steps + 1)]
    tau = awm_tau(0.4)
    expected = _reference_sample(x, velocity, tau, grid, noises)
    solver = SASolver(x, grid, tau)
    for i in range(steps):
        solver.step(i, velocity(solver.point, grid[i]), noises[i + 1])
    torch.testing.assert_close(solver.point, expected, rtol=1e-12, atol=1e-12)


def test_the_deterministic_solver_is_second_order_accurate_and_the_stochastic_one_keeps_the_marginal():
    """tau = 0: on the Gaussian's known flow, 14 steps land closer to the exact ODE end
    (x_1 x scale) than Euler does. tau = 0.4: the samples' spread stays the data's."""
    from pixelrl.sampling.schedule import linspace_shift_sigmas

    scale, steps = 0.5, 14
    velocity = _gaussian_velocity(scale)
    sigmas = linspace_shift_sigmas(steps, 3.0)
    grid = sa_solver_grid(sigmas)
    x1 = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # the exact ODE from t = grid[0] (the reference starts there with the noise as if at t = 1)
    exact = x1 * scale / math.sqrt((1 - grid[0]) ** 2 * scale ** 2 + grid[0] ** 2)
    solver = SASolver(x1, grid, lambda t: 0.0)
    for i in range(steps):
        solver.step(i, velocity(solver.point, grid[i]), torch.zeros_like(x1))
    euler = x1.clone()
    for i in range(steps):
        euler = euler + (float(sigmas[i + 1]) - float(sigmas[i])) * velocity(euler, float(sigmas[i]))
    sa_error, euler_error = (solver.point - exact).abs().max(), (euler - exact).abs().max()
    assert sa_error < 0.2 * euler_error, (sa_error, euler_error)
    gen = torch.Generator().manual_seed(3)
    solver = SASolver(x1, grid, awm_tau(0.4))
    for i in range(steps):
        solver.step(i, velocity(solver.point, grid[i]), torch.randn(4096, dtype=torch.float64, generator=gen))
    assert abs(float(solver.point.std()) - scale) < 0.03
    assert (solver.point - exact).abs().mean() > 0.05  # the noise moved the samples off the ODE path


def test_the_grid_is_the_references():
    sigmas = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.0])
    assert sa_solver_grid(sigmas) == [0.999, pytest.approx(0.9), pytest.approx(0.6), pytest.approx(0.3), 0.0]
    assert sa_solver_grid(torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0]))[-2] == pytest.approx(0.25)
    tau = awm_tau(0.4)
    assert [tau(t) for t in (0.95, 0.9, 0.5, 0.3, 0.29)] == [0.0, 0.4, 0.4, 0.4, 0.0]


def test_rollout_with_sa_solver_keeps_no_transitions_and_draws_per_sample_noise(tiny_pixel_path):
    from pixelrl.models.loader import load_folder_model
    from pixelrl.sampling.rollout import SamplingSettings, rollout
    from pixelrl.sampling.windows import Window

    model = load_folder_model(tiny_pixel_path)
    sigmas = model.sigmas(6, 32, 32)

    def sample(seeds, noise_level):
        settings = SamplingSettings(noise_level=noise_level, guidance_scale=1.0, solver="sa_solver")
        return rollout(model, ["a red square"] * len(seeds), seeds, sigmas=sigmas, window=Window(0, 0),
                       settings=settings, height=32, width=32)

    a, b = sample([1, 2], 0.7), sample([2], 0.7)
    assert a.latents.shape[1] == 0 and a.log_probs.shape[1] == 0
    torch.testing.assert_close(a.final_latents[1:], b.final_latents)  # sample 2 does not depend on its neighbour
    assert not torch.allclose(sample([2], 0.0).final_latents, b.final_latents)  # tau > 0 injected noise
    with pytest.raises(ValueError, match="keeps no transitions"):
        rollout(model, ["a red square"], [1], sigmas=sigmas, window=Window(0, 2),
                settings=SamplingSettings(noise_level=0.7, solver="sa_solver"), height=32, width=32)


def test_sa_solver_is_refused_for_transition_losses_and_awm_sd35_samples_with_it(tmp_path):
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.solver.*forward-process"):
        load_config("shapes_flow_grpo", ["rollout.solver=sa_solver"])
    with pytest.raises(ConfigError, match=r"rollout\.solver.*DPM-Solver"):
        load_config("shapes_nft", ["rollout.solver=dpm2", "rollout.noise_level=0.5"])
    cfg = load_config("shapes_awm", ["rollout.solver=sa_solver", "rollout.noise_level=0.4"])
    assert cfg.rollout.solver == "sa_solver"
