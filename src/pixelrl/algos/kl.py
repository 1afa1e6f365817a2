"""KL to the reference policy for transition losses (pure tensor math)."""

from __future__ import annotations

import torch

from pixelrl.algos.losses import kept_mean
from pixelrl.core.errors import ConfigError
from pixelrl.sampling.sde import mean_over_dims

KL_TYPES = ("reference", "exact")
KL_BATCH_KEYS = ("ref_means",)


def gaussian_step_kl(mean: torch.Tensor, other_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[B]: mean_dims((mean - other)^2) / (2 std^2) per sample, std [B, 1, ...] (0 counts as 1)."""
    variance = std.reshape(std.shape[0]).float() ** 2
    variance = torch.where(variance > 0, variance, torch.ones_like(variance))
    return mean_over_dims((mean.float() - other_mean.to(mean.device).float()) ** 2) / (2 * variance)


def step_kl_to_reference(step: dict, kl_type: str = "reference") -> tuple[torch.Tensor, dict]:
    """KL between the Gaussian steps of the policy and the reference (same std), averaged.

    `reference` (Flow-GRPO code): mean_dims((mu - mu_ref)^2) / (2 std_dev_t^2), no dt.
    `exact`: divides by the variance actually sampled, (std_dev_t sqrt(-dt))^2 for sde.
    """
    if kl_type == "reference":
        std = step["std_dev_t"]
    elif kl_type == "exact":
        std = step["noise_std"]
    else:
        raise ConfigError("diffusion_loss.kl_type", kl_type, f"choose one of {list(KL_TYPES)}")
    per_step = gaussian_step_kl(step["mean"], step["ref_mean"], std)
    mask = step.get("step_mask")  # rollout correction's kept steps, scaled to the mini-batch's kept mean
    if mask is None:
        kl = per_step.mean()
        return kl, {"kl": kl.detach()}
    return (per_step * mask).mean(), {"kl": kept_mean(per_step, mask).detach()}
