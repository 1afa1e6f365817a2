"""SA-Solver (stochastic Adams predictor-corrector) in flow-matching form: AWM's sampler.

With x_t = (1 - t) x0 + t eps, alpha_t = 1 - t, lambda_t = log(alpha_t / t) and the data
prediction D = x - t v, one update from s to t (h = lambda_t - lambda_s, c = 1 + tau^2) is

    x_t = exp(-tau^2 h) (t / s) x_s + c t exp(-tau^2 lambda_t) sum_k b_k D_k + t sqrt(1 - exp(-2 tau^2 h)) z

where b_k integrates exp(c l) times the k-th Lagrange basis polynomial through the lambdas of the
history D_k over [lambda_s, lambda_t]. tau = 0 is a deterministic multistep ODE solver; tau > 0
injects noise z while keeping the marginals. The predictor (Adams-Bashforth) interpolates the
data predictions at s and before; the corrector (Adams-Moulton) also the one at t, evaluated at
the prediction, and reuses the predictor's noise. Second-order steps add the O(h^3) "few steps"
term of the SA-Solver paper (Appendix D), as the reference and diffusers' `SASolverScheduler` do.

The driver is the reference's (`SASolver.sample`, PEC mode: one model call per step): no
corrector after the first step, lower orders near the end, and the last step to t = 0 returns
the last data prediction. AWM samples on the scheduler's grid with t_0 = 1 - 1e-3 (lambda(1) is
-inf) and the last non-zero t halved (`sa_solver_grid`), predictor and corrector of order 2,
and tau = noise_level for t in [0.3, 0.9], 0 elsewhere.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

PREDICTOR_ORDER = 2
CORRECTOR_ORDER = 2
STOCHASTIC_RANGE = (0.3, 0.9)  # t where tau = noise_level (AWM's stochasticity control)
WARMUP_STEPS = max(PREDICTOR_ORDER, CORRECTOR_ORDER - 1)  # steps before the orders are reached
HISTORY = max(PREDICTOR_ORDER, CORRECTOR_ORDER)  # data predictions an update reads


def sa_solver_grid(sigmas: torch.Tensor) -> list[float]:
    """The reference's grid from a schedule's N + 1 sigmas (ending at 0): the first moved to
    1 - 1e-3, the last non-zero one halved from its predecessor."""
    grid = [float(s) for s in sigmas]
    if len(grid) < 3 or grid[-1] != 0.0:
        raise ValueError(f"SA-Solver needs at least 2 steps ending at sigma 0, got {grid}")
    grid[-2] = grid[-3] / 2
    grid[0] = 1.0 - 1e-3
    return grid


def awm_tau(noise_level: float) -> Callable[[float], float]:
    low, high = STOCHASTIC_RANGE
    return lambda t: noise_level if low <= t <= high else 0.0


def _lambda(t: float) -> float:
    return math.log((1.0 - t) / t)


def _exp_moments(order: int, start: float, end: float, tau: float) -> list[float]:
    """I_k = integral of exp(c l) l^k dl over [start, end] for k < order, c = 1 + tau^2, by
    I_k = [l^k exp(c l) / c] - (k / c) I_{k-1} (integration by parts)."""
    c = 1.0 + tau * tau
    moments = []
    for k in range(order):
        boundary = (end ** k * math.exp(c * end) - start ** k * math.exp(c * start)) / c
        moments.append(boundary - (k / c) * moments[k - 1] if k else boundary)
    return moments


def _weights(start: float, end: float, lambdas: list[float], tau: float) -> list[float]:
    """b_k for the history at `lambdas` (newest first) over [start, end]."""
    order = len(lambdas)
    moments = _exp_moments(order, start, end, tau)
    weights = []
    for k, lam in enumerate(lambdas):
        others = [other for j, other in enumerate(lambdas) if j != k]
        poly = np.atleast_1d(np.poly(others)) / np.prod([lam - other for other in others])  # descending powers
        weights.append(float(sum(poly[j] * moments[order - 1 - j] for j in range(order))))
    return weights


def adams_update(x: torch.Tensor, history: list[torch.Tensor], times: list[float], s: float, t: float,
                 tau: float, noise: torch.Tensor, corrector: bool) -> torch.Tensor:
    """One SA update from s to t with the data predictions `history` at `times` (newest first):
    the predictor's history ends at s, the corrector's at t."""
    lam_s, lam_t = _lambda(s), _lambda(t)
    h, c = lam_t - lam_s, 1.0 + tau * tau
    b = _weights(lam_s, lam_t, [_lambda(u) for u in times], tau)
    if len(history) == 2:  # the few-steps term, O(h^3)
        inner = h * c - 1.0 + math.exp(-c * h)
        extra = math.exp(c * lam_t) * (h / 2 - inner / (c * c * h) if corrector
                                        else (h * h / 2 - inner / (c * c)) / (lam_s - _lambda(times[1])))
        b[0], b[1] = b[0] + extra, b[1] - extra
    out = math.exp(-tau * tau * h) * (t / s) * x
    scale = c * t * math.exp(-tau * tau * lam_t)
    for weight, d in zip(b, history):
        out = out + (scale * weight) * d
    return out + (t * math.sqrt(-math.expm1(-2.0 * tau * tau * h))) * noise


class SASolver:
    """One trajectory over `grid` (N + 1 times ending at 0), driven by the rollout loop: call
    `step(i, velocity, noise)` with the model's velocity at (`point`, grid[i]) for i = 0 .. N - 1
    and the standard noise for the step to grid[i + 1]; `point` is then where to call the model
    next, and after the last step the sample."""

    def __init__(self, x: torch.Tensor, grid: list[float], tau: Callable[[float], float]) -> None:
        self.grid, self.tau, self.steps = grid, tau, len(grid) - 1
        if self.steps < WARMUP_STEPS:
            raise ValueError(f"SA-Solver needs at least {WARMUP_STEPS} steps")
        self.x = x  # the corrected state at grid[i]
        self.point = x  # where the model is evaluated next
        self.history: list[torch.Tensor] = []  # data predictions, newest first
        self.noise: torch.Tensor | None = None  # the last predictor's noise, reused by its corrector

    def _orders(self, s: int) -> tuple[int, int]:
        """Predictor and corrector orders of the step into grid[s] (the reference's warm-up and
        lower_order_final)."""
        if s < WARMUP_STEPS:
            return min(PREDICTOR_ORDER, s), min(CORRECTOR_ORDER, s + 1)
        return min(PREDICTOR_ORDER, self.steps - s + 1), min(CORRECTOR_ORDER, self.steps - s + 2)

    def step(self, i: int, velocity: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        g = self.grid
        self.history.insert(0, self.point - g[i] * velocity)
        del self.history[HISTORY:]
        if i >= 2:  # correct the step into grid[i] (the reference never corrects the first step)
            order = self._orders(i)[1]
            self.x = adams_update(self.x, self.history[:order], [g[i - k] for k in range(order)], g[i - 1], g[i],
                                  self.tau(g[i]), self.noise, corrector=True)
        else:
            self.x = self.point
        if i + 1 == self.steps:  # the step to t = 0: the last data prediction
            self.point = self.history[0]
            return self.point
        order = self._orders(i + 1)[0]
        times = [g[i - k] for k in range(order)]
        self.noise = noise
        self.point = adams_update(self.x, self.history[:order], times, g[i], g[i + 1], self.tau(g[i + 1]), noise,
                                  corrector=False)
        return self.point
