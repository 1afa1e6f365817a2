"""One reverse step of a flow-matching sampler, with the log-probability of the step.

Notation (docs/algorithms/notation.md): sigma = 1 is noise, 0 is data; x_sigma = (1 - sigma) x0 + sigma eps;
the model predicts v with target eps - x0; a step goes from sigma to sigma_next < sigma, so
dt = sigma_next - sigma < 0. All of this runs in float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pixelrl.core.errors import ConfigError

SDE_TYPES = ("sde", "cps", "dance_sde", "ode")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    prev_sample: torch.Tensor  # the next (less noisy) sample
    # [B], mean over dims. A deterministic (ODE) step has no density: 0, as DiffusionOPD's stored
    # ODE transitions carry, so only a loss that reads no log-prob may train on one
    log_prob: torch.Tensor
    mean: torch.Tensor  # mean of the Gaussian transition
    std_dev_t: torch.Tensor  # [B, 1, ...]: sde/dance: the diffusion coefficient; cps: the step's std
    sqrt_dt: torch.Tensor  # [B, 1, ...]: sqrt(-dt)

    @property
    def noise_std(self) -> torch.Tensor:
        """Standard deviation of the transition actually sampled."""
        return self.std_dev_t if self.is_cps else self.std_dev_t * self.sqrt_dt

    is_cps: bool = False


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a float or a [B] tensor of sigmas to [B, 1, 1, ...] in float32."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def mean_over_dims(x: torch.Tensor) -> torch.Tensor:
    """Mean over every non-batch dimension ([B] stays as it is)."""
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Gaussian log density, element-wise, then averaged over dims (reference behaviour)."""
    return mean_over_dims(-((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI)


def sde_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sigma_max_next=None,
    logprob_reduction: str = "mean",
) -> StepOutput:
    """Step from `sigma` to `sigma_next`, sampling (or re-scoring `prev_sample`).

    `sigma_max_next` is sigmas[1] of the schedule; the `sde` coefficient uses it in place of
    sigma where sigma == 1 (the first step of an unshifted schedule), avoiding a 1 / 0.
    A list of generators draws the noise of sample i from generator i.
    """
    if sde_type not in SDE_TYPES:
        raise ConfigError("rollout.sde_type", sde_type, f"choose one of {list(SDE_TYPES)}")
    if logprob_reduction not in ("mean", "sum"):
        raise ConfigError("rollout.logprob_reduction", logprob_reduction, "choose `mean` or `sum`")
    x = sample.float()
    v = velocity.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s
    sqrt_dt = torch.sqrt(-dt)

    def draw_noise() -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        gens = list(generator) if isinstance(generator, tuple) else generator
        return randn_tensor(tuple(x.shape), generator=gens, device=x.device, dtype=torch.float32)

    is_cps = sde_type == "cps"
    if sde_type == "ode" or noise_level == 0:
        # Deterministic Euler step; `sde` with a = 0 reduces to exactly this.
        mean = x + v * dt
        zero = torch.zeros_like(s)
        return StepOutput(mean if prev_sample is None else prev_sample.float(), x.new_zeros(x.shape[0]), mean, zero,
                          sqrt_dt, is_cps)

    if sde_type == "sde":
        s_max_next = _per_sample(sigma_max_next if sigma_max_next is not None else s_next, x)
        std_dev_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, s_max_next, s)))
        mean = x * (1 + std_dev_t**2 * dt / (2 * s)) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        step_std = std_dev_t * sqrt_dt
    elif sde_type == "dance_sde":
        # DanceGRPO: Euler drift plus the score correction 0.5 a^2 (x + (1 - sigma) v) / sigma.
        std_dev_t = torch.full_like(s, float(noise_level))
        mean = x + dt * (v + 0.5 * noise_level**2 * (x + (1 - s) * v) / s)
        step_std = std_dev_t * sqrt_dt
    else:  # cps: coefficients-preserving sampling
        std_dev_t = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s * v
        eps_hat = x + (1 - s) * v
        mean = x0_hat * (1 - s_next) + eps_hat * torch.sqrt(s_next**2 - std_dev_t**2)
        step_std = std_dev_t

    if prev_sample is None:
        prev_sample = mean + step_std * draw_noise()
    else:
        prev_sample = prev_sample.float()

    if is_cps:
        # Reference behaviour: squared distance only, no variance and no constants.
        elementwise = -((prev_sample.detach() - mean) ** 2)
        log_prob = mean_over_dims(elementwise)
    else:
        log_prob = _gaussian_log_prob(prev_sample, mean, step_std)
    if logprob_reduction == "sum":
        log_prob = log_prob * float(x[0].numel())
    return StepOutput(prev_sample, log_prob, mean, std_dev_t, sqrt_dt, is_cps)
