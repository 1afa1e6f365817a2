"""DGPO, Direct Group Preference Optimization (Luo et al. 2025): a forward-process loss that turns a
group's advantages into a group-level preference, on clean samples from a deterministic sampler.

Per sample i of prompt group g, at a shared timestep with noise eps (shared within the group by
default) and flow-matching target u = eps - x0:

    d_i     = mean_dims((v_theta - u)^2)                 the policy's denoising error
    d_ref_i = mean_dims((v_ref - u)^2)                   the reference's (adapters disabled), no gradient
    w_g     = sigmoid( sum_{i in g} A_i * beta_dpo * (d_i - d_ref_i) / |g| )      no gradient
    L       = mean_i( w_g(i) * A_i * d_i ) + ref_kl_coef * mean_i( mean_dims((v_theta - v_ref)^2) )

w_g is the derivative of the group's DPO-style objective, so gradient descent on L lowers the error
of the better-than-average images and raises the worse ones', most where the group's preference
is least satisfied. With `clip_range > 0`, d_i is held (detached) where the ratio exp(d_old - d_i)
against the EMA `old` adapter leaves 1 + clip_range for A > 0 or 1 - clip_range for A < 0 (the
reference's `clip_dsm`). The sums over a group need the whole group in one micro-batch: the
engine keeps groups together when it shuffles (`LossSpec.whole_groups`), and the config checks
that micro-batches hold whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.algos.forward_process import OldPolicyParams, check_timesteps, mean_over_dims
from pixelrl.algos.losses import positive, register_loss
from pixelrl.core.errors import ConfigError, require_integer


@dataclass
class DGPOParams(OldPolicyParams):
    beta_dpo: float = 100.0  # the reference's GenEval, compressibility and OCR presets
    ref_kl_coef: float = 0.02  # weight of mean((v - v_ref)^2): the reference's train.beta
    clip_range: float = 1e-2  # 0 turns the clip and the EMA adapter off
    # `num_timesteps` distinct sampler-grid indices out of 0..max_timestep_index (the reference's
    # trunc_steps: the high-noise end of the grid), drawn once per update and shared by every sample
    timesteps: str = "grid_subset"
    num_timesteps: int = 4
    max_timestep_index: int = 4
    group_noise: bool = True  # the reference's use_shared_noise: one eps per group and timestep
    # its EMA reference: decay min(0.3, 0.001 s) after every optimizer step, s the steps before it
    # (train_sd3_dgpo.py steps `ema_ref` right after `optimizer.step()`)
    old_policy_schedule: str = "awm"
    old_policy_refresh: str = "optimizer_step"

    def __post_init__(self):
        super().__post_init__()
        check_timesteps(self)
        positive("beta_dpo", self.beta_dpo)
        for name in ("ref_kl_coef", "clip_range"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(f"diffusion_loss.params.{name}", getattr(self, name), "a finite number >= 0")
        require_integer("diffusion_loss.params.max_timestep_index", self.max_timestep_index, 0)
        if self.num_timesteps > self.max_timestep_index + 1:
            raise ConfigError("diffusion_loss.params.num_timesteps", self.num_timesteps,
                              f"draws distinct indices out of 0..max_timestep_index={self.max_timestep_index}: "
                              f"use at most {self.max_timestep_index + 1}")


@register_loss("dgpo", objective="forward_process", params=DGPOParams,
               batch_keys=("x0", "advantages", "uids"),
               step_keys=("x0", "eps", "v", "v_ref", "v_old", "advantages", "groups"),
               weighted_step_keys={"v_old": "clip_range"}, whole_groups=True)
def dgpo_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    advantages = step["advantages"].clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
    target = step["eps"] - step["x0"]
    err = mean_over_dims((step["v"] - target) ** 2)
    with torch.no_grad():
        ref_err = mean_over_dims((step["v_ref"] - target) ** 2)
    metrics = {}
    if step.get("v_old") is not None:  # PPO-style hold against the EMA reference
        with torch.no_grad():
            ratio = torch.exp(mean_over_dims((step["v_old"] - target) ** 2) - err)
            hold = torch.where(advantages > 0, ratio > 1 + cfg.clip_range, ratio < 1 - cfg.clip_range)
        err = torch.where(hold, err.detach(), err)
        metrics["clipfrac"] = hold.float().mean()
    groups = step["groups"]
    # the engine passes the count it knows on the host: reading groups.max() back from the
    # device would stall every micro-batch
    num_groups = step.get("num_groups") or int(groups.max()) + 1
    with torch.no_grad():
        size = torch.bincount(groups, minlength=num_groups).to(err.dtype)
        inside = torch.zeros(num_groups, device=err.device, dtype=err.dtype).index_add_(
            0, groups, advantages * cfg.beta_dpo * (err.detach() - ref_err)) / size
        weight = torch.sigmoid(inside)[groups]
    policy_loss = (weight * advantages * err).mean()
    loss = policy_loss
    if cfg.ref_kl_coef > 0:
        kl = mean_over_dims((step["v"] - step["v_ref"]) ** 2).mean()
        loss = loss + cfg.ref_kl_coef * kl
        metrics["ref_deviation"] = kl.detach()
    return loss, {"policy_loss": policy_loss.detach(), "dsm_loss": err.detach().mean(),
                  "group_weight": weight.mean(), **metrics}
