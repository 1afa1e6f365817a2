"""Method families as registered specs: what each asks of the rest of the house.

A method family is the value of `algorithm.trainer_type` and the `objective` its losses name
(`transition`: the Flow-GRPO family re-scores the sampler's stored SDE steps; `forward_process`:
Diffusion-DPO, DiffusionNFT, AWM and DGPO re-noise the clean samples; `distribution_matching`:
DMD2's cycle of attempts over two trained roles). Its `MethodSpec` says what the config, the
planner, the engine and the controller need to know of it; none of them branches on a method's
name. The engine's objective class and the controller's consumer register under the same name at
their own layers (`engine.objectives.OBJECTIVES`, `trainers.consumers.CONSUMERS`), since they sit
above this one; a plugin's method registers all three the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pixelrl.core.registry import Registry

METHODS: Registry = Registry("method family", "algorithm.trainer_type")

# the role a single-policy method trains (its adapter is the engine's `default`)
POLICY_ROLE = "policy"


def _no_checks(cfg) -> None:
    return None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    # the networks the method steps, each with its own optimizer and counters; the first is the
    # engine's policy (validated, exported, EMA-averaged)
    trained_roles: tuple[str, ...] = (POLICY_ROLE,)
    # True: the shared producer samples, scores and groups the step's images for the consumer;
    # False: the method's attempts sample their own prompts (DMD2) and no producer runs
    samples_through_producer: bool = True
    # whether the method's training reads rewards (False: rewards score validation only)
    reads_rewards: bool = True
    # its losses replay the rollout's stored SDE transitions (log-probs, step means): it needs a
    # stochastic sampler with a window, can re-score a stale batch (a separate rollout pool and the
    # asynchronous modes serve it), and reads diffusion_loss's clip and KL fields
    rescores_transitions: bool = False
    # the method reads a frozen teacher whatever the loss's options (DMD2's real score)
    reads_teacher: bool = False
    # it trains on images the dataset holds (supervised fine-tuning's demonstration rows, each
    # with a `target`), read at rollout.resolution, instead of prompts it samples for
    trains_on_demonstrations: bool = False
    # (diffusion_loss section) -> the attempts of one training step in order, each a trained
    # role's name; None: one rollout per step, trained for actor.ppo_epochs x mini-batches
    attempt_cycle: Callable | None = None
    # the metrics that say how its training goes, in order: printed on each step's console line,
    # drawn first in the run report, and the first one a run logged is its done line's
    training_metrics: tuple[str, ...] = ("critic/rewards/mean",)
    # the method's own rules on the run's config (the whole config object; each check names the
    # sections it reads); the rules every method shares stay in config/validation.py
    check: Callable = _no_checks

    def attempts_of(self, loss_cfg, role: str) -> int | None:
        """`role`'s attempts (optimizer steps at most) in one training step, or None when the step
        is one rollout trained for the actor's epochs and mini-batches."""
        if self.attempt_cycle is None:
            return None
        return list(self.attempt_cycle(loss_cfg)).count(role)


def register_method(spec: MethodSpec) -> MethodSpec:
    METHODS.register(spec.name)(spec)
    return spec


def method_of(cfg) -> MethodSpec:
    """The run's method family (`algorithm.trainer_type`)."""
    return METHODS.get(cfg.algorithm.trainer_type)


def method_of_loss(loss) -> MethodSpec:
    """The method family a registered loss (its `LossSpec`) trains under."""
    return METHODS.get(loss.objective, "diffusion_loss.name")


def training_metric_keys() -> tuple[str, ...]:
    """Every registered method's `training_metrics`, each once, in registration order (the
    built-in methods first): what a run's console line and report look for whatever ran."""
    keys: dict[str, None] = {}
    for spec in METHODS.entries():
        keys.update(dict.fromkeys(spec.training_metrics))
    return tuple(keys)


def trained_role_prefixes() -> tuple[str, ...]:
    """The metric prefixes of every method's trained roles beyond the policy (DMD2's `student/`,
    `fake_score/`): their metrics keep the prefix where others drop `actor/`."""
    return tuple(dict.fromkeys(f"{role}/" for spec in METHODS.entries() for role in spec.trained_roles
                               if role != POLICY_ROLE))
