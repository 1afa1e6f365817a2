"""Supervised fine-tuning on demonstrations: the flow-matching loss on (prompt, target image) rows.

The `supervised` method family trains a policy toward images a dataset holds, not toward a
reward: each target is encoded to its clean latent x0, noised at a drawn timestep t to
x_t = (1 - t) x0 + t eps, and the velocity the denoiser predicts there is pulled onto the flow's,
eps - x0 (the loss the families were pre-trained with). Users reach for it when their reward is
weak or to start RL from a policy that already draws the task (Flow-Factory's and Miles-Diffusion's
SFT trainers). Nothing is sampled and no reward is read in training; rewards score validation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.algos.forward_process import check_timesteps
from pixelrl.algos.losses import register_loss
from pixelrl.algos.methods import MethodSpec, register_method
from pixelrl.core.errors import ConfigError
from pixelrl.sampling.sde import mean_over_dims


@dataclass
class SFTParams:
    # timestep draws, as the forward-process methods draw them; logit_normal: t from the
    # 1000-step training schedule at idx = floor(1000 u), u ~ LogitNormal(0, 1) (SD3's training)
    timesteps: str = "logit_normal"
    num_timesteps: int = 1  # (noise, timestep) draws per row and epoch

    def __post_init__(self):
        check_timesteps(self)


@register_loss("sft", objective="supervised", params=SFTParams, batch_keys=("x0",), step_keys=("v", "eps", "x0"))
def sft_loss(step: dict, cfg) -> tuple[torch.Tensor, dict]:
    """L = mean_rows mean_dims((v - (eps - x0))^2): the flow-matching error of each row's target."""
    err = mean_over_dims((step["v"] - (step["eps"] - step["x0"])) ** 2)
    loss = err.mean()
    return loss, {"sft_loss": loss.detach(), "flow_error_max": err.detach().max()}


def check_supervised(cfg) -> None:
    """Demonstrations come from data.train_files; nothing is sampled for training."""
    if cfg.algorithm.sample_source != "online":
        raise ConfigError("algorithm.sample_source", cfg.algorithm.sample_source, "supervised fine-tuning reads its "
                          "demonstrations from data.train_files (rows with a `target` image); sample_source=offline is "
                          "Diffusion-DPO's preference pairs: leave it at online")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", list(cfg.data.train_files), "supervised fine-tuning trains on "
                          "demonstration rows ({prompt, target}: an image path relative to the file, or bytes): name "
                          "a .jsonl or .parquet of them (`pixelrl make-demonstrations` writes the shapes world's)")
    if cfg.rollout.n != 1:
        raise ConfigError("rollout.n", cfg.rollout.n, "supervised fine-tuning samples nothing: each demonstration row "
                          "is one trained image and a step trains data.train_batch_size of them; set rollout.n=1")
    if cfg.diffusion_loss.kl_coef:
        raise ConfigError("diffusion_loss.kl_coef", cfg.diffusion_loss.kl_coef, "sft reads no reference policy: set 0")


register_method(MethodSpec("supervised", samples_through_producer=False, reads_rewards=False,
                           trains_on_demonstrations=True, training_metrics=("actor/sft_loss",),
                           check=check_supervised))
