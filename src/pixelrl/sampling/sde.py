"""One reverse step of a flow-matching sampler, with the log-probability of the step.

Notation (docs/algorithms/notation.md): sigma = 1 is noise, 0 is data; x_sigma = (1 - sigma) x0 + sigma eps;
the model predicts v with target eps - x0; a step goes from sigma to sigma_next < sigma, so
dt = sigma_next - sigma < 0. All of this runs in float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pixelrl.core.errors import ConfigError
from pixelrl.core.registry import Registry

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
    # the rule's std_dev_t is already the step's standard deviation (cps), not a coefficient of sqrt(-dt)
    std_is_the_steps: bool = False

    @property
    def noise_std(self) -> torch.Tensor:
        """Standard deviation of the transition actually sampled."""
        return self.std_dev_t if self.std_is_the_steps else self.std_dev_t * self.sqrt_dt


def _no_checks(noise_level: float, solver: str) -> None:
    """A rule that takes any noise level with any solver."""


@dataclass(frozen=True)
class SdeRule:
    """One reverse-step rule (`rollout.sde_type`): the Gaussian a step from sigma to sigma_next
    draws from, how its log-density is written, and its own checks on the rollout section."""
    name: str
    # (x, v, sigma, sigma_next, dt, sqrt_dt, noise_level, sigma_max_next) -> (mean, std_dev_t, the
    # step's std), all float32 [B, ...]; None: the deterministic Euler step, which stores no density
    moments: Callable | None
    # (prev_sample, mean, the step's std) -> [B] log-density, averaged over dims
    log_prob: Callable | None = None
    std_is_the_steps: bool = False
    # (rollout.noise_level, rollout.solver) -> None, or the ConfigError naming the field and the fix
    check: Callable = _no_checks

    @property
    def deterministic(self) -> bool:
        return self.moments is None


SDE_RULES: Registry[SdeRule] = Registry("SDE type", "rollout.sde_type")


def register_sde_rule(rule: SdeRule) -> SdeRule:
    SDE_RULES.register(rule.name)(rule)
    return rule


def sde_rule(name: str) -> SdeRule:
    """The registered rule `name`, or the ConfigError naming rollout.sde_type and the choices."""
    return SDE_RULES.get(name)


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
    rule = sde_rule(sde_type)
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

    if rule.deterministic or noise_level == 0:
        # Deterministic Euler step; `sde` with a = 0 reduces to exactly this.
        mean = x + v * dt
        zero = torch.zeros_like(s)
        return StepOutput(mean if prev_sample is None else prev_sample.float(), x.new_zeros(x.shape[0]), mean, zero,
                          sqrt_dt, rule.std_is_the_steps)

    s_max_next = _per_sample(sigma_max_next if sigma_max_next is not None else s_next, x)
    mean, std_dev_t, step_std = rule.moments(x, v, s, s_next, dt, sqrt_dt, float(noise_level), s_max_next)
    if prev_sample is None:
        prev_sample = mean + step_std * draw_noise()
    else:
        prev_sample = prev_sample.float()
    log_prob = rule.log_prob(prev_sample, mean, step_std)
    if logprob_reduction == "sum":
        log_prob = log_prob * float(x[0].numel())
    return StepOutput(prev_sample, log_prob, mean, std_dev_t, sqrt_dt, rule.std_is_the_steps)


def _flow_grpo_moments(x, v, s, s_next, dt, sqrt_dt, noise_level, s_max_next):
    """Flow-GRPO's SDE: std_dev_t = a sqrt(sigma / (1 - sigma)), with sigmas[1] in place of sigma
    where sigma == 1 (the first step of an unshifted schedule), avoiding a 1 / 0."""
    std_dev_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, s_max_next, s)))
    mean = x * (1 + std_dev_t**2 * dt / (2 * s)) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t, std_dev_t * sqrt_dt


def _dance_moments(x, v, s, s_next, dt, sqrt_dt, noise_level, s_max_next):
    """DanceGRPO: Euler drift plus the score correction 0.5 a^2 (x + (1 - sigma) v) / sigma."""
    std_dev_t = torch.full_like(s, noise_level)
    mean = x + dt * (v + 0.5 * noise_level**2 * (x + (1 - s) * v) / s)
    return mean, std_dev_t, std_dev_t * sqrt_dt


def _cps_moments(x, v, s, s_next, dt, sqrt_dt, noise_level, s_max_next):
    """Coefficients-preserving sampling: the predicted x0 and eps recombined at sigma_next, with
    sin(a pi / 2) of sigma_next kept as fresh noise."""
    std_dev_t = s_next * math.sin(noise_level * math.pi / 2)
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v
    mean = x0_hat * (1 - s_next) + eps_hat * torch.sqrt(s_next**2 - std_dev_t**2)
    return mean, std_dev_t, std_dev_t


def _squared_distance(prev_sample, mean, step_std):
    """CPS's reference log-probability: the squared distance only, no variance and no constants."""
    return mean_over_dims(-((prev_sample.detach() - mean) ** 2))


def _check_cps(noise_level: float, solver: str) -> None:
    if noise_level > 1:
        raise ConfigError("rollout.noise_level", noise_level, "CPS keeps sin(a pi / 2) of sigma_next as noise, "
                          "which grows only up to a = 1 (all noise), so a > 1 repeats a smaller level: use a in "
                          "[0, 1] (the reference: 0.8)")


def _check_ode(noise_level: float, solver: str) -> None:
    if noise_level > 0 or solver != "euler":
        field, value = ("rollout.noise_level", noise_level) if noise_level > 0 else ("rollout.solver", solver)
        raise ConfigError(field, value, "rollout.sde_type=ode stores deterministic Euler steps: set "
                          "rollout.noise_level=0 and rollout.solver=euler (or another sde_type for noise)")


register_sde_rule(SdeRule("sde", _flow_grpo_moments, _gaussian_log_prob))
register_sde_rule(SdeRule("cps", _cps_moments, _squared_distance, std_is_the_steps=True, check=_check_cps))
register_sde_rule(SdeRule("dance_sde", _dance_moments, _gaussian_log_prob))
register_sde_rule(SdeRule("ode", None, check=_check_ode))
