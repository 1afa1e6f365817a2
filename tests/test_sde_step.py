"""sde_step against hand-computed numbers (docs/algorithms/notation.md)."""

import math

import pytest
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.sampling import sde_step

X = torch.tensor([[1.0]])
V = torch.tensor([[0.5]])
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def test_ode_is_the_euler_step():
    x, v = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    out = sde_step(x, v, 0.8, 0.6, noise_level=0.7, sde_type="ode")
    dt = torch.tensor(0.6) - torch.tensor(0.8)  # float32, as the step computes it
    assert torch.equal(out.prev_sample, x + v * dt)
    assert torch.equal(out.log_prob, torch.zeros(3))  # no density: no weight


def test_sde_with_zero_noise_is_exactly_the_euler_step():
    x, v = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    out = sde_step(x, v, torch.tensor([0.9, 0.5, 0.3]), torch.tensor([0.8, 0.4, 0.2]), noise_level=0.0)
    dt = torch.tensor([-0.1, -0.1, -0.1]).view(3, 1, 1, 1)
    expected = x + v * (torch.tensor([0.8, 0.4, 0.2]) - torch.tensor([0.9, 0.5, 0.3])).view(3, 1, 1, 1)
    assert torch.equal(out.prev_sample, expected)
    assert torch.allclose(out.prev_sample, x + v * dt, atol=1e-6)


def test_sde_mean_std_and_log_prob_hand_computed():
    # sigma 0.5 -> 0.25, a = 0.5: std_dev_t = 0.5 sqrt(0.5 / 0.5) = 0.5; dt = -0.25
    # mean = 1 (1 + 0.25 * -0.25 / 1) + 0.5 (1 + 0.25 * 0.5 / 1)(-0.25) = 0.9375 - 0.140625
    out = sde_step(X, V, 0.5, 0.25, noise_level=0.5, prev_sample=torch.tensor([[0.9]]))
    assert out.std_dev_t.item() == pytest.approx(0.5)
    assert out.sqrt_dt.item() == pytest.approx(0.5)
    assert out.mean.item() == pytest.approx(0.796875)
    # log N(0.9; 0.796875, 0.25^2) = -(0.103125^2)/(2 * 0.0625) - log 0.25 - log sqrt(2 pi)
    assert out.log_prob.item() == pytest.approx(0.3822777029, abs=1e-6)
    assert out.noise_std.item() == pytest.approx(0.25)


def test_sde_uses_sigma_max_next_where_sigma_is_one():
    out = sde_step(X, V, 1.0, 0.9, noise_level=0.7, sigma_max_next=0.9, prev_sample=X)
    assert out.std_dev_t.item() == pytest.approx(0.7 * math.sqrt(1.0 / (1 - 0.9)), rel=1e-5)
    assert torch.isfinite(out.log_prob).all()


def test_sde_log_prob_of_its_own_sample_is_the_gaussian_density_averaged_over_dims():
    torch.manual_seed(0)
    x, v = torch.randn(4, 3, 6, 6), torch.randn(4, 3, 6, 6)
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3])
    out = sde_step(x, v, sigma, sigma - 0.1, noise_level=0.8, generator=torch.Generator().manual_seed(1))
    dist = torch.distributions.Normal(out.mean, out.std_dev_t * out.sqrt_dt)
    expected = dist.log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    assert torch.allclose(out.log_prob, expected, atol=1e-5)
    # and the draw really has that spread
    z = (out.prev_sample - out.mean) / (out.std_dev_t * out.sqrt_dt)
    assert abs(float(z.std()) - 1.0) < 0.1


def test_sum_reduction_multiplies_by_the_number_of_dims():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    nxt = torch.randn(2, 3, 4, 4)
    mean_lp = sde_step(x, v, 0.6, 0.5, noise_level=0.7, prev_sample=nxt).log_prob
    sum_lp = sde_step(x, v, 0.6, 0.5, noise_level=0.7, prev_sample=nxt, logprob_reduction="sum").log_prob
    assert torch.allclose(sum_lp, mean_lp * 48)


def test_cps_hand_computed():
    # std = 0.25 sin(pi / 4); x0_hat = 0.75, eps_hat = 1.25
    # mean = 0.75 * 0.75 + 1.25 sqrt(0.0625 - std^2); log_prob = -(0.9 - mean)^2
    out = sde_step(X, V, 0.5, 0.25, noise_level=0.5, sde_type="cps", prev_sample=torch.tensor([[0.9]]))
    assert out.std_dev_t.item() == pytest.approx(0.1767766953, abs=1e-7)
    assert out.mean.item() == pytest.approx(0.7834708691, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-0.0135790383, abs=1e-7)
    assert out.noise_std.item() == pytest.approx(0.1767766953, abs=1e-7)


def test_cps_with_zero_noise_is_the_euler_step():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    out = sde_step(x, v, 0.7, 0.4, noise_level=1e-12, sde_type="cps", prev_sample=x)
    assert torch.allclose(out.mean, x + v * (0.4 - 0.7), atol=1e-6)


def test_dance_sde_hand_computed():
    # sigma 0.8 -> 0.6, a = 0.5: mean = 1 - 0.2 (0.5 + 0.125 (1 + 0.2 * 0.5) / 0.8) = 0.865625
    # std = 0.5 sqrt(0.2); log_prob = log N(0.9; mean, std^2)
    out = sde_step(X, V, 0.8, 0.6, noise_level=0.5, sde_type="dance_sde", prev_sample=torch.tensor([[0.9]]))
    assert out.mean.item() == pytest.approx(0.865625)
    assert out.noise_std.item() == pytest.approx(0.2236067977)
    assert out.log_prob.item() == pytest.approx(0.5671111973, abs=1e-6)


def test_per_sample_generators_make_each_draw_independent_of_the_batch():
    x, v = torch.zeros(2, 8), torch.zeros(2, 8)
    both = sde_step(x, v, 0.5, 0.4, noise_level=0.7,
                    generator=[torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)])
    alone = sde_step(x[1:], v[1:], 0.5, 0.4, noise_level=0.7, generator=[torch.Generator().manual_seed(4)])
    assert torch.equal(both.prev_sample[1:], alone.prev_sample)


def test_unknown_sde_type_names_the_field():
    with pytest.raises(ConfigError, match="rollout.sde_type"):
        sde_step(X, V, 0.5, 0.4, noise_level=0.7, sde_type="euler")


def test_dpm_solver_2m_matches_diffusers_on_its_flow_sigmas():
    """Our DPM-Solver++ (2M) against diffusers' DPMSolverMultistepScheduler (dpmsolver++,
    midpoint, flow sigmas, shift 3) on a fixed nonlinear velocity field, step by step."""
    from diffusers import DPMSolverMultistepScheduler

    from pixelrl.sampling.multistep import DPMSolverPP2M

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0,
                                            solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint",
                                            lower_order_final=True, final_sigmas_type="zero")
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.double()
    assert sigmas[-1] == 0 and len(sigmas) == 11

    def velocity(x, sigma):
        return torch.tanh(x) * (1 + sigma) - 0.3 * x ** 2

    x0 = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours, theirs, solver = x0.clone(), x0.clone(), DPMSolverPP2M()
    for i, t in enumerate(scheduler.timesteps):
        ours = solver.step(ours, velocity(ours, float(sigmas[i])), float(sigmas[i]), float(sigmas[i + 1]))
        theirs = scheduler.step(velocity(theirs, float(sigmas[i])), t, theirs, return_dict=False)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # and second order matters: a first-order (DDIM) run on the same grid ends elsewhere
    ddim = x0.clone()
    for i in range(10):
        ddim = DPMSolverPP2M().step(ddim, velocity(ddim, float(sigmas[i])), float(sigmas[i]), float(sigmas[i + 1]))
    assert (ddim - theirs).abs().max() > 1e-3


def test_dpm_solver_first_step_from_sigma_one_is_the_ddim_step():
    from pixelrl.sampling.multistep import DPMSolverPP2M

    x, v = torch.tensor([2.0]), torch.tensor([0.5])
    # x0 = x - 1 * v = 1.5; x_t = sigma_t x + (1 - sigma_t) x0 = 0.8 * 2 + 0.2 * 1.5 = 1.9
    assert torch.allclose(DPMSolverPP2M().step(x, v, 1.0, 0.8), torch.tensor([1.9]))


def test_a_registered_sde_rule_samples_scores_and_checks_the_config_with_no_other_file_changed(monkeypatch):
    """A new `rollout.sde_type` is one SdeRule (its moments, log-density and checks) and one
    registration: sde_step draws from its Gaussian and scores with its log-density, and the
    rollout section's check runs the rule's own check."""
    from pixelrl.sampling import SDE_RULES, SdeRule
    from pixelrl.sampling.config import RolloutConfig

    def moments(x, v, s, s_next, dt, sqrt_dt, noise_level, s_max_next):  # Euler drift, std a sqrt(-dt)
        std = torch.full_like(s, noise_level)
        return x + v * dt, std, std * sqrt_dt

    def check(noise_level, solver):
        if noise_level > 0.5:
            raise ConfigError("rollout.noise_level", noise_level, "this rule takes at most 0.5")

    rule = SdeRule("euler_maruyama_for_test", moments, lambda prev, mean, std: -((prev - mean) / std).abs().mean(1),
                   check=check)
    monkeypatch.setitem(SDE_RULES._entries, rule.name, rule)  # removed again after the test
    generator = torch.Generator().manual_seed(3)
    out = sde_step(X, V, 0.8, 0.6, noise_level=0.4, sde_type=rule.name, generator=generator)
    step_std = 0.4 * math.sqrt(0.2)
    noise = torch.randn((1, 1), generator=torch.Generator().manual_seed(3))
    assert out.mean.item() == pytest.approx(1.0 + 0.5 * -0.2)
    assert out.prev_sample.item() == pytest.approx(0.9 + step_std * noise.item(), abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-abs(noise.item()), abs=1e-5)
    assert out.noise_std.item() == pytest.approx(step_std)
    RolloutConfig(sde_type=rule.name, noise_level=0.4).check()
    with pytest.raises(ConfigError, match="rollout.noise_level.*this rule takes at most 0.5"):
        RolloutConfig(sde_type=rule.name, noise_level=0.7).check()
    with pytest.raises(ConfigError, match="rollout.sde_type"):
        RolloutConfig(sde_type="no_such_rule").check()
