"""DPM-Solver++ (2M), the deterministic second-order multistep sampler, in flow-matching form.

With x_sigma = (1 - sigma) x0 + sigma eps, alpha = 1 - sigma, lambda = log(alpha / sigma) and the
data prediction D = x - sigma v, one step from s to t (h = lambda_t - lambda_s) is

    x_t = (sigma_t / sigma_s) x_s - alpha_t (exp(-h) - 1) D'
    D'  = D_s                                     first order (first step, or no usable history)
    D'  = D_s + (D_s - D_prev) / (2 r),  r = (lambda_s - lambda_prev) / h      second order

and the step to sigma = 0 returns D_s (first order at the end, as diffusers' `lower_order_final`
does for short schedules). This is diffusers' `DPMSolverMultistepScheduler` (dpmsolver++,
midpoint, flow sigmas) on pixelrl's own sigma grid; a test checks the two agree. Schedules that
start at sigma = 1 (lambda = -inf) make the first step exactly the DDIM step to sigma_1.
"""

from __future__ import annotations

import math

import torch

SOLVERS = ("euler", "dpm2", "sa_solver")  # sa_solver: pixelrl.sampling.sa_solver


def _lambda(sigma: float) -> float:
    return -math.inf if sigma >= 1.0 else math.log((1.0 - sigma) / sigma)


class DPMSolverPP2M:
    """Stateful over one trajectory: call `step` once per grid interval, in order."""

    def __init__(self) -> None:
        self.prev_x0: torch.Tensor | None = None
        self.prev_lambda = -math.inf

    def step(self, x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
        x0 = x - sigma * velocity
        if sigma_next <= 0.0:
            out = x0
        else:
            lam_s, lam_t = _lambda(sigma), _lambda(sigma_next)
            h = lam_t - lam_s
            d = x0
            if self.prev_x0 is not None and math.isfinite(self.prev_lambda) and math.isfinite(lam_s):
                r = (lam_s - self.prev_lambda) / h
                d = x0 + (x0 - self.prev_x0) / (2.0 * r)
            out = (sigma_next / sigma) * x - (1.0 - sigma_next) * math.expm1(-h) * d
        self.prev_x0, self.prev_lambda = x0, _lambda(sigma)
        return out
