"""One consumer per method family, all called by the controller through one signature.

`consume(ctx: StepContext) -> (batch, metrics)` runs one training step of the run's method
(`algorithm.trainer_type`): the batch it trained on (None when the step sampled nothing the
controller can dump or draw) and the step's metrics, with `timing_s/step` and, once the actor
stepped, `actor/policy_version`. A method that samples through the shared producer (its
`MethodSpec.samples_through_producer`) wraps its update in `trained_on_rollout`, which samples or
takes the step's batch from the rollout pool and handles a failing reward; one that samples
itself (DMD2) takes prompts with `ctx.next_rows`. Consumers register under their method's name
(`register_consumer`), the built-ins in the module of their update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pixelrl.core.errors import RewardError
from pixelrl.core.registry import Registry
from pixelrl.trainers.step import make_rollout, train_on_transitions

CONSUMERS: Registry = Registry("consumer", "algorithm.trainer_type")


@dataclass
class StepContext:
    """What the controller hands a consumer for training step `step` of `total`."""

    actor: object  # the actor worker group
    rewards: object  # the reward scorer (colocated or a pool)
    cfg: object  # the run's checked config
    step: int
    total: int
    next_rows: Callable[[], dict]  # the loader's next batch of rows (a new epoch when one ends)
    ahead: object | None  # the rollout pool's producer (trainer.mode one_step_off / async), or None
    actor_version: int  # the actor's optimizer steps so far: a batch sampled before is stale
    reward_errors: object  # the run's RewardErrorPolicy
    estimated_peak_gb: float | None = None  # the planner's peak memory estimate, logged beside the measured


def register_consumer(name: str):
    """Register `fn(ctx) -> (batch, metrics)` as method family `name`'s consumer."""
    return CONSUMERS.register(name)


def timeline_metrics(info: dict, train_start: float, train_end: float) -> dict[str, float]:
    """Wall-clock phase boundaries of a step (seconds since the epoch), for timelines: sampling
    and scoring as the workers saw them, training as the driver did."""
    out = {"timeline/train_start": train_start, "timeline/train_end": train_end}
    for key in ("gen_start", "gen_end", "reward_start", "reward_end"):
        if key in info:
            out[f"timeline/{key}"] = float(info[key])
    return out


def trained_on_rollout(ctx: StepContext, update: Callable) -> tuple:
    """The shared producer's step: the rollout of this step (sampled now, or by the rollout pool
    ahead of time), then `update(actor, rollout, cfg, num_workers=, actor_version=) -> metrics`.
    A reward that fails under `reward.on_error: skip` skips the update; the row says so."""
    step_start = time.time()
    cfg = ctx.cfg
    try:
        if ctx.ahead is not None:
            rollout = ctx.ahead.rollout_for(ctx.step, ctx.total)
        else:
            rows = ctx.next_rows()
            rollout = make_rollout(ctx.actor, ctx.rewards, rows["prompts"], rows["metadata"], ctx.step, cfg,
                                   data_sources=rows["data_sources"], condition_images=rows.get("condition_images"))
    except RewardError as err:
        ctx.reward_errors.failed(ctx.step, err)  # raises unless the step is to be skipped
        rollout = None
    if rollout is None:  # skipped: no update; the row says so and nothing else
        return None, {"reward/error": 1.0, "timing_s/step": time.time() - step_start}
    ctx.reward_errors.succeeded()
    train_start = time.time()
    metrics = update(ctx.actor, rollout, cfg, num_workers=ctx.actor.data_size, actor_version=ctx.actor_version)
    metrics.update(timeline_metrics(rollout.batch.info, train_start, time.time()))
    metrics["reward/error"] = 0.0
    if ctx.estimated_peak_gb is not None:
        metrics["perf/estimated_peak_memory_gb"] = ctx.estimated_peak_gb
    return rollout.batch, metrics


class RolloutConsumer:
    """The consumer of a method that samples through the shared producer: the step's rollout,
    then `update` on it (also callable alone on a rollout, as the gradient-noise benchmark does)."""

    def __init__(self, update: Callable):
        self.update = update

    def __call__(self, ctx: StepContext) -> tuple:
        return trained_on_rollout(ctx, self.update)


# The Flow-GRPO family: the producer's rollout, its stored SDE steps re-scored and trained
register_consumer("transition")(RolloutConsumer(train_on_transitions))
