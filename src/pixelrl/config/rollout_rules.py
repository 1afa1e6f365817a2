"""The rollout options that change what the producer samples (an oversampling pool, a lossy
accelerator), against the method that trains on it: rules spanning `rollout:` and the method."""

from __future__ import annotations

from pixelrl.algos.methods import method_of
from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.errors import ConfigError


def check_pool_and_accelerator(cfg: PixelRLConfig) -> None:
    """A lossy accelerator only where the update reads clean samples alone; the oversampling pool
    ranks the images a step samples by the run's rewards, and what it keeps without sampling
    again has no SDE transitions."""
    over, method = cfg.rollout.oversample, method_of(cfg)
    _check_accelerator(cfg, method)
    if not over.enabled:
        return
    if not (method.samples_through_producer and method.reads_rewards and cfg.algorithm.sample_source == "online"):
        why = (f"algorithm.sample_source={cfg.algorithm.sample_source} trains on the dataset's images"
               if cfg.algorithm.sample_source != "online" else f"{method.name} trains on no rewarded rollout")
        raise ConfigError("rollout.oversample.factor", over.factor, f"ranks the images a step samples by their "
                          f"rewards, and {why}: set rollout.oversample.factor=1")
    if not over.regenerate and method.rescores_transitions:
        raise ConfigError("rollout.oversample.regenerate", False, f"`{cfg.diffusion_loss.name}` re-scores the "
                          "rollout's stored SDE steps, and the pool's deterministic samples store none: set "
                          "rollout.oversample.regenerate=true")


def _check_accelerator(cfg: PixelRLConfig, method) -> None:
    """A lossy rollout accelerator samples something close to the sampler's output, not its exact
    computation: only for updates that read the clean samples alone."""
    from pixelrl.sampling.accelerators import ACCELERATORS

    name = cfg.rollout.accelerator
    if ACCELERATORS.get(name).lossless:
        return
    if method.rescores_transitions:
        raise ConfigError("rollout.accelerator", name, f"is lossy, and `{cfg.diffusion_loss.name}` re-scores the "
                          "rollout's own SDE steps, whose log-probabilities must be the sampler's exact computation: "
                          "use rollout.accelerator=none (lossy accelerators serve the forward-process methods)")
    if not method.samples_through_producer or cfg.algorithm.sample_source != "online":
        why = (f"algorithm.sample_source={cfg.algorithm.sample_source} trains on the dataset's images"
               if cfg.algorithm.sample_source != "online" else f"{method.name} samples its own attempts")
        raise ConfigError("rollout.accelerator", name, f"accelerates the producer's rollouts, and {why}: use "
                          "rollout.accelerator=none")
