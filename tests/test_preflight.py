"""The optimizer preflight: after the first optimizer step (and every `actor.preflight_every`) the
learner measures whether Adam's epsilon is small beside the gradients, and the driver warns with
the fix when it is not."""

import math

import pytest
import torch

from pixelrl.engine.learner import Learner
from pixelrl.engine.preflight import measure, preflight_warnings


def _stepped(grad_scale: float, eps: float, every: int = 0, steps: int = 1):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 32))
    learner = Learner(lambda: [weight], lr=1e-3, eps=eps, max_grad_norm=float("inf"), preflight_every=every)
    outs = []
    for _ in range(steps):
        learner.zero_grad()
        (grad_scale * (weight * torch.randn(64, 32, generator=torch.Generator().manual_seed(1))).sum()).backward()
        outs.append(learner.step(1.0))
    return outs, weight


def test_measured_by_hand_on_the_first_step():
    """Step 1: m_hat = g, v_hat = g^2, so Adam's normalised step is g / (|g| + eps) entry by entry;
    the RMS of the gradient is its norm over sqrt(numel)."""
    (out,), _ = _stepped(1e-8, eps=1e-8)
    g = 1e-8 * torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert out["preflight/grad_rms"] == pytest.approx(float(g.norm()) / math.sqrt(g.numel()), rel=1e-5)
    assert out["preflight/eps_over_grad_rms"] == pytest.approx(1e-8 / out["preflight/grad_rms"], rel=1e-6)
    normalised = g / (g.abs() + 1e-8)
    assert out["preflight/update_rms_over_lr"] == pytest.approx(float(normalised.pow(2).mean().sqrt()), rel=1e-4)
    assert out["preflight/zero_grad_share"] == 0.0


def test_it_fires_on_tiny_gradients_and_is_silent_on_ordinary_ones():
    (tiny,), _ = _stepped(5e-9, eps=1e-8)  # UniRL's case: gradient RMS ~5e-9 against eps 1e-8
    lines = preflight_warnings({f"actor/{k}": v for k, v in tiny.items()})
    assert len(lines) == 1 and "actor.adam_eps" in lines[0] and tiny["preflight/update_rms_over_lr"] < 0.5
    (ordinary,), _ = _stepped(1.0, eps=1e-8)
    assert ordinary["preflight/update_rms_over_lr"] == pytest.approx(1.0, abs=1e-3)
    assert preflight_warnings({f"actor/{k}": v for k, v in ordinary.items()}) == []


def test_it_runs_on_the_first_step_and_every_nth_only():
    outs, _ = _stepped(1.0, eps=1e-8, every=3, steps=7)
    assert ["preflight/grad_rms" in out for out in outs] == [True, False, True, False, False, True, False]


def test_a_loss_that_never_reaches_most_weights_is_named():
    weight = torch.nn.Parameter(torch.zeros(10))
    learner = Learner(lambda: [weight], lr=1e-3, eps=1e-8)
    weight[:1].sum().backward()
    metrics = {f"fake_score/{k}": v for k, v in learner.step(1.0).items()}
    assert metrics["fake_score/preflight/zero_grad_share"] == pytest.approx(0.9)
    (line,) = [line for line in preflight_warnings(metrics) if "no gradient" in line]
    assert "fake_score" in line and "90.0%" in line


def test_a_first_gradient_of_exactly_zero_is_measured_at_the_next_update_that_has_one():
    """A DMD2 student's first update has no gradient (its fake score starts equal to the real
    one): the preflight waits for the next update with a gradient, and a gradient that stays
    zero is measured (and named) at the fourth update."""
    weight = torch.nn.Parameter(torch.ones(8))
    learner = Learner(lambda: [weight], lr=1e-3, eps=1e-8)
    measured = []
    for scale in (0.0, 1.0, 1.0):
        learner.zero_grad()
        (scale * weight).sum().backward()
        measured.append("preflight/grad_rms" in learner.step(1.0))
    assert measured == [False, True, False]
    stuck = Learner(lambda: [weight], lr=1e-3, eps=1e-8)
    outs = []
    for _ in range(5):
        stuck.zero_grad()
        (0.0 * weight).sum().backward()
        outs.append(stuck.step(1.0))
    assert ["preflight/grad_rms" in out for out in outs] == [False, False, False, True, False]
    assert any("no gradient" in line for line in preflight_warnings({f"actor/{k}": v for k, v in outs[3].items()}))


def test_measure_reads_adams_own_state():
    """The normalised step comes from the optimizer's moments: two steps of opposite gradients
    leave m_hat near 0, so the update is small although eps is not the cause."""
    weight = torch.nn.Parameter(torch.ones(100))
    optimizer = torch.optim.AdamW([weight], lr=1e-3, eps=1e-8)
    for sign in (1.0, -1.0):
        optimizer.zero_grad()
        (sign * weight.sum()).backward()
        optimizer.step()
    out = measure([weight], optimizer, clipped_norm=10.0, eps=1e-8)
    m_hat = (0.9 * 0.1 - 0.1) / (1 - 0.9 ** 2)
    v_hat = (0.999 * 0.001 + 0.001) / (1 - 0.999 ** 2)
    assert out["preflight/update_rms_over_lr"] == pytest.approx(abs(m_hat) / (v_hat ** 0.5 + 1e-8), rel=1e-4)
