"""The forward-process consumer (Diffusion-DPO, DiffusionNFT, AWM and DGPO) and supervised
fine-tuning's, which trains the same objective on a dataset's images.

The producer is the shared one (`make_rollout`), but only the final clean samples are used: the
consumer trains the `forward_process` objective, noising them again at sampled timesteps.
DiffusionNFT samples with its `old` adapter (`diffusion_loss.params.rollout_policy: old`); DPO pairs the
best and worst image of each prompt.
"""

from __future__ import annotations

import numpy as np
import torch

from pixelrl.algos.forward_process import best_worst_pairs
from pixelrl.algos.losses import get_loss
from pixelrl.core.batch import Batch
from pixelrl.core.seeding import derive_seed
from pixelrl.engine.config import mini_batches_per_epoch
from pixelrl.engine.objectives import group_indices
from pixelrl.trainers.consumers import RolloutConsumer, StepContext, register_consumer
from pixelrl.trainers.step import (PhaseTimer, Rollout, actor_step_metrics, step_seed, summary_metrics,
                                   without_zero_advantages)


def label_draws(train: Batch, seed: int | None = None) -> Batch:
    """Key the forward-process draws of the whole step's batch before the workers split it: each
    row gets a distinct `draw_label` (a random relabelling drawn from `seed`, so rows that share a
    timestep draw, `samples_per_timestep_draw`, are picked at random; in order without a seed) and
    each prompt group a `draw_group`. The objective draws a row's noise from its label, so no two
    rows on any workers draw alike and the draws do not depend on the worker split."""
    n = len(train)
    train["draw_label"] = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) \
        if seed is not None else torch.arange(n)
    if "uids" in train:
        train["draw_group"] = group_indices(train["uids"])
    return train


def train_on_forward_process(actor, rollout: Rollout, cfg, num_workers: int = 1,
                             actor_version: int | None = None) -> dict[str, float]:
    """(best/worst pairs, or the samples with A != 0) -> update on the clean samples. Forward-process
    losses never re-score the sampler's trajectory, so `actor_version` changes nothing here."""
    timer = PhaseTimer()
    batch = rollout.batch
    pairs = get_loss(cfg.diffusion_loss.name).trains_on_pairs
    with timer.phase("adv"):
        if pairs:
            chosen, rejected = best_worst_pairs(batch["rewards"], batch["uids"])
            train = Batch({"x0": batch["x0"][chosen], "x0_rejected": batch["x0"][rejected]},
                          {key: [batch[key][i] for i in chosen] for key in ("prompts", "condition_images")
                           if key in batch}, dict(batch.info))
            train.info["num_mini_batches"] = mini_batches_per_epoch(cfg)
        else:  # DiffusionNFT, AWM, DGPO: every sample, or (drop_zero_advantage) those with A != 0
            train = without_zero_advantages(Batch({"x0": batch["x0"], "advantages": batch["advantages"]},
                                                  {key: batch[key] for key in ("prompts", "uids", "condition_images")
                                                   if key in batch},
                                                  dict(batch.info)),
                                            rollout.step, cfg, num_workers)
        label_draws(train, derive_seed(step_seed(cfg.rollout.seed, rollout.step), "draw_labels"))
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)
    metrics = summary_metrics(rollout, actor_metrics, timer, num_workers)
    if pairs:
        metrics["training/pairs"] = len(train)
    else:
        metrics["training/trained_fraction"] = len(train) / len(batch)
    return metrics


def offline_preference_step(actor, rows: dict, cfg, num_workers: int = 1) -> dict[str, float]:
    """Diffusion-DPO on a batch of dataset pairs: encode chosen and rejected images to clean
    latents on the workers, then update, both under the row's prompt (and an edit's sources). A
    row holds its whole pair, so no mini-batch splits one."""
    metrics = dataset_step(actor, Batch({"images": rows["chosen"], "images_rejected": rows["rejected"]}),
                           conditions_of(rows), cfg)
    for key, values in rows["scores"].items():
        known = [v for v in values if v is not None]
        if known:
            metrics[f"data/{key}/mean"] = float(np.mean(known))
    metrics["training/pairs"] = metrics.pop("training/rows")
    metrics["perf/throughput"] = metrics["training/pairs"] / metrics["timing_s/step"] / num_workers  # pairs/s/worker
    return metrics


def conditions_of(rows: dict) -> dict:
    """What a loader batch's images are trained under: its prompts, and an edit's sources."""
    return {key: rows[key] for key in ("prompts", "condition_images") if key in rows}


def dataset_step(actor, images: Batch, conditions: dict, cfg) -> dict[str, float]:
    """One update on images a dataset holds (`images`, and a pair's `images_rejected`): encoded to
    clean latents on the workers, their forward-process draws labelled, then trained under their
    rows' `conditions` (the prompts, and an edit's `condition_images`)."""
    timer = PhaseTimer()
    with timer.phase("encode"):
        clean = actor.encode(images)
    train = Batch(dict(clean.tensors), dict(conditions), {"num_mini_batches": mini_batches_per_epoch(cfg)})
    label_draws(train)
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)
    metrics = actor_step_metrics(actor_metrics)
    metrics.update({f"timing_s/{name}": secs for name, secs in timer.seconds.items()})
    metrics["timing_s/step"] = sum(timer.seconds.values())
    metrics["training/rows"] = len(train)
    return metrics


def supervised_step(ctx: StepContext) -> tuple:
    """Supervised fine-tuning's step: the loader's demonstrations, their targets trained on (an
    edit's under its sources)."""
    rows = ctx.next_rows()
    metrics = dataset_step(ctx.actor, Batch({"images": rows["targets"]}), conditions_of(rows), ctx.cfg)
    metrics["perf/throughput"] = metrics["training/rows"] / metrics["timing_s/step"] / ctx.actor.data_size
    return None, metrics


register_consumer("supervised")(supervised_step)


class ForwardProcessConsumer(RolloutConsumer):
    """Online: the producer's clean samples (or best/worst pairs) trained at drawn timesteps;
    offline (algorithm.sample_source=offline): the loader's preference pairs, nothing sampled."""

    def __call__(self, ctx: StepContext) -> tuple:
        if ctx.cfg.algorithm.sample_source == "offline":
            return None, offline_preference_step(ctx.actor, ctx.next_rows(), ctx.cfg, ctx.actor.data_size)
        return super().__call__(ctx)


register_consumer("forward_process")(ForwardProcessConsumer(train_on_forward_process))
