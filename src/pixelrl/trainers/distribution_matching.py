"""The distribution-matching consumer (DMD2): one training step is one update cycle.

There is no producer and no reward in the loop: each attempt of the cycle (`diffusion_loss.params.
cycle`, e.g. [student, fake_score, fake_score]) takes fresh prompts from the loader, repeats each
`rollout.n` times with seeds of its own, draws the student's exit step (one for every worker) and
asks the workers to train that role on them. Rewards, when configured, score validation only.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pixelrl.algos.distribution_matching import cycle_of, reuses_rollout
from pixelrl.core.seeding import derive_seed
from pixelrl.trainers.consumers import StepContext, register_consumer
from pixelrl.trainers.step import PhaseTimer, expand_prompts, step_seed


def attempt_request(rows: dict, step: int, attempt: int, cfg):
    """The (prompt, seed) rows of attempt `attempt` of training step `step` and its exit step.
    With `reuse_rollout` every attempt of the step takes the rows and initial noises of its first
    and draws its own exit step and score stream (`score_stream`)."""
    first = step_seed(cfg.rollout.seed, step) * len(cycle_of(cfg.diffusion_loss))
    own = first + attempt  # distinct for every attempt of the run
    reuse = reuses_rollout(cfg.diffusion_loss)
    request = expand_prompts(rows["prompts"], rows["metadata"], cfg.rollout.n, first if reuse else own,
                             data_sources=rows["data_sources"], condition_images=rows.get("condition_images"))
    draw = torch.Generator().manual_seed(derive_seed(own, "dmd2_exit_index"))
    request.info["exit_index"] = int(torch.randint(0, cfg.rollout.num_steps, (1,), generator=draw))
    if reuse:
        request.info["score_stream"] = attempt
    return request


def train_distribution_matching(actor, next_rows, step: int, cfg, num_workers: int = 1) -> dict[str, float]:
    """Run training step `step`'s cycle of attempts; its metrics are each role's means over its
    attempts (`student/...`, `fake_score/...`)."""
    timer = PhaseTimer()
    cycle = cycle_of(cfg.diffusion_loss)
    values: dict[str, list[float]] = defaultdict(list)
    images = 0
    rows = next_rows() if reuses_rollout(cfg.diffusion_loss) else None  # one rollout for the whole cycle
    for attempt, role in enumerate(cycle):
        request = attempt_request(rows if rows is not None else next_rows(), step, attempt, cfg)
        images += len(request)
        with timer.phase(role):
            out = actor.call("train_role", request, role, gather="mean")
        for key, value in out.items():
            values[key].append(value)
    metrics = {key: float(np.mean(v)) for key, v in values.items()}
    # the student is the policy: its optimizer steps are the policy version the controller tracks
    metrics["actor/policy_version"] = float(actor.call("counters", gather="first")["policy_version"])
    metrics.update({f"timing_s/{name}": secs for name, secs in timer.seconds.items()})
    metrics["timing_s/step"] = sum(timer.seconds.values())
    metrics["perf/throughput"] = images / metrics["timing_s/step"] / num_workers  # student samples per second per worker
    return metrics


@register_consumer("distribution_matching")
def consume_distribution_matching(ctx: StepContext) -> tuple:
    """DMD2: the step's cycle of attempts, each on prompts of its own; no producer, no reward."""
    return None, train_distribution_matching(ctx.actor, ctx.next_rows, ctx.step, ctx.cfg, ctx.actor.data_size)
