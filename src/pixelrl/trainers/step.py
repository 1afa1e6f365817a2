"""One policy-gradient step as data, shared by every controller (in-process or Ray).

`actor` is anything with `rollout(prompts, seeds, window=...)`, `score(batch, policy)` and
`update(batch)`: a `PolicyEngine` in one process, or a worker group that shards the batch.
The controller never runs a model forward itself.
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager

import torch

from pixelrl.algos.advantages import get_advantage_estimator, group_reward_stats, zero_advantage_keep
from pixelrl.algos.rollout_correction import rollout_correction_weights
from pixelrl.core.batch import Batch
from pixelrl.core.config import mini_batches_per_epoch
from pixelrl.core.seeding import derive_seed
from pixelrl.sampling.windows import choose_window, trained_step_indices

# Sample seeds live in disjoint ranges per step: seed_i = step_seed * SEED_STRIDE + i, so two
# steps never reuse a noise seed.
SEED_STRIDE = 1 << 20


def step_seed(rollout_seed: int, global_step: int) -> int:
    """Per-step rollout seed (verl convention): rollout.seed + global_step - 1."""
    return rollout_seed + global_step - 1


def expand_prompts(prompts: list[str], metadata: list[dict], n: int, seed: int, uids=None) -> Batch:
    """Give each prompt a uid, repeat it n times (groups stay contiguous), seed each sample."""
    uids = uids or [uuid.uuid4().hex for _ in prompts]
    base = Batch(values={"prompts": list(prompts), "metadata": list(metadata), "uids": list(uids)})
    batch = base.repeat_interleave(n)
    batch["seeds"] = [seed * SEED_STRIDE + i for i in range(len(batch))]
    return batch


def group_noise_seeds(seeds: list[int], n: int) -> list[int]:
    """DanceGRPO's shared initial noise: every image of a group starts from one noise, drawn from
    a stream derived from the group's first seed (never the stream of any sample's SDE noise)."""
    return [derive_seed(s - (i % n), "group_initial_noise") for i, s in enumerate(seeds)]


def compute_advantages(rewards: torch.Tensor, uids: list, algo_cfg) -> torch.Tensor:
    estimator = get_advantage_estimator(algo_cfg.adv_estimator)
    options = dict(norm_by_std=algo_cfg.norm_adv_by_std_in_grpo, global_std=algo_cfg.global_std,
                   eps=algo_cfg.adv_eps)
    if algo_cfg.adv_std_unbiased:
        options["unbiased"] = True
    return estimator(rewards, uids, **options)


def aggregate_advantages(scores: dict[str, torch.Tensor], uids: list, cfg) -> torch.Tensor:
    """Advantages of the weighted reward sum, or (`sum_advantages`) the weighted sum of each
    reward's own advantages."""
    if cfg.algorithm.reward_aggregation == "sum_rewards":
        return compute_advantages(scores["overall"], uids, cfg.algorithm)
    total = torch.zeros_like(scores["overall"])
    for spec in cfg.reward.functions:
        total = total + float(spec.get("weight", 1.0)) * compute_advantages(scores[spec["name"]], uids, cfg.algorithm)
    return total


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.float()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def policy_gradient_step(actor, reward_fn, prompts: list[str], metadata: list[dict], global_step: int, cfg,
                         uids=None, num_workers: int = 1) -> tuple[Batch, dict[str, float]]:
    """generate -> reward -> advantages (-> drop zero ones) -> (re-score old) -> (reference) -> update.

    Returns the whole scored batch (for dumps) and the step's metrics; `num_workers` is the size
    of the actor group, so that a reduced batch still splits evenly.
    """
    timer = PhaseTimer()
    seed = step_seed(cfg.rollout.seed, global_step)
    samples = expand_prompts(prompts, metadata, cfg.rollout.n, seed, uids)
    r = cfg.rollout
    window = choose_window(r.num_steps, r.sde_window_size, r.sde_window_range, seed,
                           schedule=r.sde_window_schedule, global_step=global_step, window_seed=r.window_seed,
                           stride=r.mixgrpo_stride, iters_per_group=r.mixgrpo_iters_per_group,
                           rollback=r.mixgrpo_rollback)

    noise_seeds = group_noise_seeds(samples["seeds"], r.n) if r.same_noise_per_group else None
    with timer.phase("gen"):
        batch = actor.rollout(samples["prompts"], samples["seeds"], window=window, noise_seeds=noise_seeds)
        batch.update(Batch(values={"metadata": samples["metadata"], "uids": samples["uids"]}))
    with timer.phase("reward"):
        scores = reward_fn(batch["images"], batch["prompts"], batch["metadata"])
        rewards = scores["overall"]
        batch["rewards"] = rewards
    with timer.phase("adv"):
        batch["advantages"] = aggregate_advantages(scores, batch["uids"], cfg)
        if cfg.actor.timestep_fraction < 1.0 or cfg.actor.permute_timesteps:
            batch["train_step_index"] = trained_step_indices(
                window.size, len(batch), num_steps=r.num_steps, fraction=cfg.actor.timestep_fraction,
                permute=cfg.actor.permute_timesteps, seed=derive_seed(seed, "trained_steps"))
        num_mini = mini_batches_per_epoch(cfg)
        train = batch
        if cfg.algorithm.drop_zero_advantage:
            keep = zero_advantage_keep(batch["advantages"], num_mini * num_workers,
                                       torch.Generator().manual_seed(derive_seed(seed, "zero_advantage")))
            train = batch.select(keep)
        train.info["num_mini_batches"] = num_mini
    correction_metrics: dict[str, float] = {}
    if cfg.algorithm.rollout_correction == "decoupled":
        with timer.phase("old_log_prob"):
            train.update(actor.score(train, "old"))
            a = cfg.algorithm
            train["is_weights"], correction_metrics = rollout_correction_weights(
                train["old_log_probs"], train["log_probs"], step_indices=train["step_indices"],
                threshold=a.rollout_is_threshold, lower=a.rollout_rs_lower, upper=a.rollout_rs_upper)
    if cfg.diffusion_loss.kl_coef > 0:
        with timer.phase("ref"):
            train.update(actor.score(train, "reference"))
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)

    metrics = summary_metrics(batch, scores, actor_metrics, timer)
    metrics["training/trained_fraction"] = len(train) / len(batch)
    metrics.update(correction_metrics)
    metrics["training/window_start"] = window.start
    metrics["training/window_size"] = window.size
    return batch, metrics


def summary_metrics(batch: Batch, scores: dict, actor_metrics: dict, timer: PhaseTimer) -> dict[str, float]:
    """Reward, advantage, actor and timing metrics of a step (names as verl-omni's)."""
    num_images = len(batch)
    rewards = scores["overall"]
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/rewards", rewards))
    for name, values in scores.items():
        if name != "overall":
            metrics[f"critic/rewards/{name}/mean"] = float(values.mean())
    stats = group_reward_stats(rewards, batch["uids"])
    metrics.update({f"critic/rewards/{k}": v for k, v in stats.items()})
    metrics.update(_stats("critic/advantages", batch["advantages"]))
    metrics["critic/advantages/zero_frac"] = float((batch["advantages"] == 0).float().mean())
    metrics.update({f"actor/{k}": v for k, v in actor_metrics.items()})
    total = sum(timer.seconds.values())
    for name, secs in timer.seconds.items():
        metrics[f"timing_s/{name}"] = secs
        metrics[f"timing_per_image_ms/{name}"] = 1000 * secs / num_images
    metrics["timing_s/step"] = total
    metrics["perf/throughput"] = num_images / total
    return metrics
