"""KL to the reference policy for transition losses (pure tensor math)."""

from __future__ import annotations

import torch

from pixelrl.algos.losses import kept_mean
from pixelrl.core.errors import ConfigError
from pixelrl.sampling.sde import mean_over_dims

KL_TYPES = ("reference", "exact")
KL_BATCH_KEYS = ("ref_means",)


def step_kl_to_reference(step: dict, kl_type: str = "reference") -> tuple[torch.Tensor, dict]:
    """KL between the Gaussian steps of the policy and the reference (same std), averaged.

    `reference` (Flow-GRPO code): mean_dims((mu - mu_ref)^2) / (2 std_dev_t^2), no dt.
    `exact`: divides by the variance actually sampled, (std_dev_t sqrt(-dt))^2 for sde.
    """
    sq = mean_over_dims((step["mean"] - step["ref_mean"].to(step["mean"].dtype)) ** 2)
    if kl_type == "reference":
        std = step["std_dev_t"]
    elif kl_type == "exact":
        std = step["noise_std"]
    else:
        raise ConfigError("diffusion_loss.kl_type", kl_type, f"choose one of {list(KL_TYPES)}")
    per_step = sq / (2 * std.reshape(std.shape[0]) ** 2)
    mask = step.get("step_mask")  # rollout correction's kept steps, scaled to the mini-batch's kept mean
    if mask is None:
        kl = per_step.mean()
        return kl, {"kl": kl.detach()}
    return (per_step * mask).mean(), {"kl": kept_mean(per_step, mask).detach()}
