"""The `actor:` section (the optimizer and how a step's samples split into optimizer steps and
forwards), the sections an engine is built from, and the update schedule they imply."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pixelrl.algos.config import DiffusionLossConfig
from pixelrl.core.errors import ConfigError, check_choice, check_number, check_size
from pixelrl.models.config import ModelConfig
from pixelrl.sampling.config import RolloutConfig


@dataclass
class UpdateConfig:
    """The optimizer, its lr schedule, and how a step's samples split into optimizer steps and
    forwards: what every trainer's `actor:` section holds."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    # > 0 (instead of warmup_steps): warm up over ceil(ratio x the run's optimizer steps), as
    # LightRFT's lr_warmup_ratio
    warmup_ratio: float = 0.0
    # after warm-up: constant (the diffusion references), or cosine (half a cosine from lr down to
    # min_lr_ratio x lr at the run's last optimizer step, verl's lr_scheduler_type: cosine)
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    # the optimizer preflight (engine/preflight.py: is Adam's epsilon small beside the gradients?)
    # after the first optimizer step and every this many after it; 0: after the first only
    preflight_every: int = 200
    # skipped updates in a row before the run stops; 0: skip every non-finite update and go on,
    # counting them (verl-omni's DMD2)
    max_consecutive_nonfinite: int = 3
    ppo_epochs: int = 1
    # Samples per optimizer step, counted over all workers: the step's train_batch_size x rollout.n
    # samples make (samples / ppo_mini_batch_size) optimizer steps per epoch; 0 = the whole batch.
    # Flow-GRPO's paper setting takes two steps per rollout batch, MixGRPO four.
    ppo_mini_batch_size: int = 0
    ppo_micro_batch_size: int = 4  # samples per forward/backward
    shuffle: bool = True

    def check(self) -> None:
        """The optimizer's numbers (the schedule over the run is checked with the run's length)."""
        from pixelrl.engine.learner import LR_SCHEDULES

        for name in ("lr", "ppo_epochs", "adam_eps"):
            check_number(f"actor.{name}", getattr(self, name))
        check_size("actor.ppo_micro_batch_size", self.ppo_micro_batch_size)
        check_number("actor.max_grad_norm", self.max_grad_norm, allow_inf=True)  # inf = no clipping
        check_number("actor.weight_decay", self.weight_decay, allow_zero=True)
        check_number("actor.preflight_every", self.preflight_every, allow_zero=True)
        if self.max_consecutive_nonfinite < 0:
            raise ConfigError("actor.max_consecutive_nonfinite", self.max_consecutive_nonfinite, "a whole number >= 0: "
                              "the skipped non-finite updates in a row that stop the run (3), or 0 to keep skipping")
        check_number("actor.warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError("actor.warmup_ratio", self.warmup_ratio, "the share of the run's optimizer steps spent "
                              "warming up, in [0, 1) (LightRFT: 0.03)")
        if self.warmup_ratio and self.warmup_steps:
            raise ConfigError("actor.warmup_ratio", self.warmup_ratio, f"and actor.warmup_steps = {self.warmup_steps} "
                              "both set the warm-up: keep one, set the other to 0")
        betas = list(self.betas)
        if len(betas) != 2 or any(not (isinstance(b, (int, float)) and 0 <= b < 1) for b in betas):
            raise ConfigError("actor.betas", betas, "Adam's two decay rates, each in [0, 1), e.g. [0.9, 0.999]")
        check_choice("actor.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("actor.min_lr_ratio", self.min_lr_ratio, "the cosine's floor as a fraction of "
                              "actor.lr, in [0, 1]")

    def warmup_steps_of(self, total_steps: int) -> int:
        """The warm-up in optimizer steps, for a run of `total_steps` of them."""
        return math.ceil(self.warmup_ratio * total_steps) if self.warmup_ratio else self.warmup_steps


@dataclass
class ActorConfig(UpdateConfig):
    """The diffusion trainers' `actor:` section: the update, and which window steps it trains."""

    ppo_micro_batch_size: int | str = 4  # samples per forward/backward; auto: the largest that fits
    # Trained window steps of a micro-batch in one forward/backward (and in one no-grad forward
    # when scoring the reference or old policy); 0 = all. The same update up to float reordering,
    # fewer and larger calls, activation memory x this. Losses with batch statistics need 1.
    window_steps_per_forward: int = 1
    # In order: train the first int(num_steps * fraction) window steps (Flow-GRPO). Permuted
    # (DanceGRPO): a random int(W * fraction) of the W window steps per sample.
    timestep_fraction: float = 1.0
    permute_timesteps: bool = False
    # > 0: keep an EMA of the trained weights, updated after every `ema_update_interval`-th
    # optimizer step s with decay min((1 + s) / (10 + s), ema_decay) (or ema_decay, without
    # ema_warmup); validation, the checkpoints'
    # evaluation and `pixelrl export` use it (flow_grpo's and DiffusionNFT's train.ema: 0.9)
    ema_decay: float = 0.0
    ema_update_interval: int = 1
    # false: the decay is ema_decay from the first update on (verl-omni's DMD2 student EMA), not
    # warmed up as min((1 + s) / (10 + s), ema_decay)
    ema_warmup: bool = True

    def check(self) -> None:
        super().check()
        check_number("actor.ema_update_interval", self.ema_update_interval)
        check_number("actor.window_steps_per_forward", self.window_steps_per_forward, allow_zero=True)
        if not 0 <= self.ema_decay < 1:
            raise ConfigError("actor.ema_decay", self.ema_decay, "must be in [0, 1): 0 keeps no EMA of the trained "
                              "weights; flow_grpo and DiffusionNFT keep one at 0.9")
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError("actor.timestep_fraction", self.timestep_fraction, "must be in (0, 1]")


@dataclass
class EngineConfig:
    """Everything a `PolicyEngine` needs: one model, its sampler and its optimizer."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    diffusion_loss: DiffusionLossConfig = field(default_factory=DiffusionLossConfig)
    seed: int = 0  # seeds LoRA init and mini-batch shuffling


# The update schedule. `cfg` is a run's whole config (pixelrl.config.PixelRLConfig): the schedule
# spans its data, rollout, actor and trainer sections.

def images_per_step(cfg) -> int:
    """The rows one training step trains on: its rollout's images (prompts x rollout.n), or the
    loader's batch of offline preference pairs (nothing is sampled for them: rollout.n counts none)."""
    if getattr(cfg.algorithm, "sample_source", "online") == "offline":
        return cfg.data.train_batch_size
    return cfg.data.train_batch_size * cfg.rollout.n


def mini_batches_per_epoch(cfg) -> int:
    """Optimizer steps per inner epoch: the step's images split into mini-batches."""
    images = images_per_step(cfg)
    return images // (cfg.actor.ppo_mini_batch_size or images)


def optimizer_steps_per_rollout(cfg, role: str = "student") -> int:
    """Optimizer steps taken on one rollout batch (the reference update schedule); for a method
    whose step is a cycle of attempts (DMD2), `role`'s attempts per training step."""
    if hasattr(cfg, "diffusion_loss"):
        from pixelrl.algos.losses import LOSSES
        from pixelrl.algos.methods import method_of_loss

        attempts = method_of_loss(LOSSES.get(cfg.diffusion_loss.name)).attempts_of(cfg.diffusion_loss, role)
        if attempts is not None:
            return attempts
    return cfg.actor.ppo_epochs * mini_batches_per_epoch(cfg)


def actor_optimizer_steps(cfg, frozen_steps: int = 0, role: str = "student") -> int:
    """Optimizer steps the actor (or another trained `role`) takes over the whole run (what a
    cosine lr decays over), when the first `frozen_steps` training steps update no actor (the
    vision-language critic warm-up)."""
    return optimizer_steps_per_rollout(cfg, role) * (cfg.trainer.total_training_steps - frozen_steps)
