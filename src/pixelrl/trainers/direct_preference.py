"""One direct-preference step as data: Diffusion-DPO, DiffusionNFT and AWM.

Same producer shape as the policy-gradient step (prompts -> seeded samples -> rewards ->
advantages), but only the final clean samples are kept: the consumer trains the `flow_matching`
objective, noising them again at sampled timesteps. DiffusionNFT samples with its `old` adapter
(`algorithm.rollout_policy: old`); DPO pairs the best and worst image of each prompt.
"""

from __future__ import annotations

import numpy as np

from pixelrl.algos.forward_process import best_worst_pairs
from pixelrl.algos.advantages import group_reward_stats
from pixelrl.core.batch import Batch
from pixelrl.core.config import mini_batches_per_epoch
from pixelrl.sampling.windows import Window, choose_window
from pixelrl.trainers.step import PhaseTimer, aggregate_advantages, expand_prompts, step_seed, summary_metrics


def direct_preference_step(actor, reward_fn, prompts: list[str], metadata: list[dict], global_step: int, cfg,
                           uids=None, num_workers: int = 1) -> tuple[Batch, dict[str, float]]:
    """generate (current or old policy) -> reward -> advantages (-> pairs) -> update."""
    timer = PhaseTimer()
    seed = step_seed(cfg.rollout.seed, global_step)
    samples = expand_prompts(prompts, metadata, cfg.rollout.n, seed, uids)
    r = cfg.rollout
    # Only the clean sample is kept: a deterministic sampler stores no trajectory at all.
    window = (Window(0, 0) if r.noise_level == 0 else
              choose_window(r.num_steps, r.sde_window_size, r.sde_window_range, seed, schedule=r.sde_window_schedule,
                            global_step=global_step, window_seed=r.window_seed, stride=r.mixgrpo_stride,
                            iters_per_group=r.mixgrpo_iters_per_group, rollback=r.mixgrpo_rollback))
    with timer.phase("gen"):
        batch = actor.rollout(samples["prompts"], samples["seeds"], window=window,
                              policy=cfg.algorithm.rollout_policy)
        batch.update(Batch(values={"metadata": samples["metadata"], "uids": samples["uids"]}))
    with timer.phase("reward"):
        scores = reward_fn(batch["images"], batch["prompts"], batch["metadata"])
        batch["rewards"] = scores["overall"]
    with timer.phase("adv"):
        batch["advantages"] = aggregate_advantages(scores, batch["uids"], cfg)
        if cfg.diffusion_loss.name == "diffusion_dpo":
            chosen, rejected = best_worst_pairs(batch["rewards"], batch["uids"])
            train = Batch({"x0": batch["x0"][chosen], "x0_rejected": batch["x0"][rejected]},
                          {"prompts": [batch["prompts"][i] for i in chosen]}, dict(batch.info))
        else:
            train = Batch({"x0": batch["x0"], "advantages": batch["advantages"]}, {"prompts": batch["prompts"]},
                          dict(batch.info))
        train.info["num_mini_batches"] = mini_batches_per_epoch(cfg)
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)
    metrics = summary_metrics(batch, scores, actor_metrics, timer)
    if cfg.diffusion_loss.name == "diffusion_dpo":
        metrics["training/pairs"] = len(train)
    return batch, metrics


def offline_preference_step(actor, rows: dict, cfg) -> dict[str, float]:
    """Diffusion-DPO on a batch of dataset pairs: encode chosen and rejected images to clean
    latents on the workers, then update. A row holds its whole pair, so no mini-batch splits one."""
    timer = PhaseTimer()
    with timer.phase("encode"):
        pairs = actor.encode(Batch({"images": rows["chosen"], "images_rejected": rows["rejected"]}))
    train = Batch({"x0": pairs["x0"], "x0_rejected": pairs["x0_rejected"]}, {"prompts": rows["prompts"]},
                  {"num_mini_batches": mini_batches_per_epoch(cfg)})
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)
    metrics = {f"actor/{k}": v for k, v in actor_metrics.items()}
    for key, values in rows["scores"].items():
        known = [v for v in values if v is not None]
        if known:
            metrics[f"data/{key}/mean"] = float(np.mean(known))
    metrics.update({f"timing_s/{name}": secs for name, secs in timer.seconds.items()})
    metrics["timing_s/step"] = sum(timer.seconds.values())
    metrics["training/pairs"] = len(train)
    metrics["perf/throughput"] = len(train) / metrics["timing_s/step"]  # pairs per second
    return metrics
