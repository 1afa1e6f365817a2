"""One training step as data, split into a producer and a consumer (every controller uses them).

Producer (`make_rollout`): prompts -> seeded samples -> rewards -> advantages, returned as a
`Rollout` tagged with the policy version that sampled it. Consumer (`train_on_transitions`): a rollout ->
(re-score old log-probs) -> (reference) -> update -> metrics. The synchronous trainer runs one
after the other; the asynchronous ones (pixelrl.trainers.async_schedule) run the producer on a
separate rollout pool ahead of the consumer.

`actor` is anything with `rollout(prompts, seeds, window=...)`, `score(batch, policy)` and
`update(batch)`: a `PolicyEngine` in one process, or a worker group that shards the batch.
The controller never runs a model forward itself.
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pixelrl.algos.advantages import gdpo_advantages, get_advantage_estimator, group_reward_stats, zero_advantage_keep
from pixelrl.algos.forward_process import rollout_policy
from pixelrl.algos.losses import LOSSES
from pixelrl.algos.rollout_correction import rollout_correction
from pixelrl.core.batch import Batch
from pixelrl.engine.config import mini_batches_per_epoch
from pixelrl.core.seeding import derive_seed
from pixelrl.sampling.rollout import stores_transitions
from pixelrl.sampling.windows import Window, choose_window, trained_step_indices

# Sample seeds live in disjoint ranges per step: seed_i = step_seed * SEED_STRIDE + i, so two
# steps never reuse a noise seed.
SEED_STRIDE = 1 << 20


def step_seed(rollout_seed: int, global_step: int) -> int:
    """Per-step rollout seed (verl convention): rollout.seed + global_step - 1."""
    return rollout_seed + global_step - 1


def expand_prompts(prompts: list[str], metadata: list[dict], n: int, seed: int, uids=None,
                   data_sources: list[str] | None = None, condition_images: list | None = None) -> Batch:
    """Give each prompt a uid, repeat it n times (groups stay contiguous), seed each sample; with
    `data_sources`, each sample keeps its row's (a distillation teacher is chosen by it)."""
    uids = uids or [uuid.uuid4().hex for _ in prompts]
    base = Batch(values={"prompts": list(prompts), "metadata": list(metadata), "uids": list(uids),
                         **({"data_sources": list(data_sources)} if data_sources is not None else {}),
                         **({"condition_images": list(condition_images)} if condition_images is not None else {})})
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
    reward's own advantages, or (`gdpo`) that sum of per-group normalised rewards normalised over
    the batch."""
    if cfg.algorithm.reward_aggregation == "sum_rewards":
        return compute_advantages(scores["overall"], uids, cfg.algorithm)
    if cfg.algorithm.reward_aggregation == "gdpo":
        functions = cfg.reward.functions
        return gdpo_advantages({f["name"]: scores[f["name"]] for f in functions},
                               {f["name"]: float(f.get("weight", 1.0)) for f in functions}, uids)
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


# ---------------------------------------------------------------------------------- producer
@dataclass
class Rollout:
    """A scored batch with its advantages, tagged with its step and the policy that sampled it:
    `batch.info["policy_version"]` counts the sampler's optimizer steps, `weights_step` the
    training steps its weights had seen (step - 1 when on-policy)."""

    step: int
    batch: Batch
    scores: dict[str, torch.Tensor]
    window: Window
    seconds: dict[str, float] = field(default_factory=dict)
    weights_step: int = 0


def sampling_policy(cfg) -> str:
    """The adapter the rollouts sample with: the loss's `rollout_policy` param (DiffusionNFT's
    `old`), else the current policy."""
    return rollout_policy(LOSSES.get(cfg.diffusion_loss.name).bind(cfg.diffusion_loss))


def plan_rollout(prompts: list[str], metadata: list[dict], global_step: int, cfg, uids=None,
                 data_sources: list[str] | None = None, condition_images: list | None = None) -> tuple[Batch, Window]:
    """What step `global_step` samples: prompts with uids repeated n times (n x the oversampling
    factor: the candidates of the pool), per-sample seeds (and DanceGRPO's shared group noise
    seeds), and the SDE window. A deterministic sampler (noise_level 0, unless sde_type is `ode`)
    or a multistep solver stores no transition, so its window is empty."""
    r = cfg.rollout
    seed = step_seed(r.seed, global_step)
    request = expand_prompts(prompts, metadata, r.n * r.oversample.factor, seed, uids, data_sources, condition_images)
    if r.same_noise_per_group:
        request["noise_seeds"] = group_noise_seeds(request["seeds"], r.n)
    if not stores_transitions(r.noise_level, r.solver, r.sde_type):
        return request, Window(0, 0)
    return request, choose_window(r.num_steps, r.sde_window_size, r.sde_window_range, seed,
                                  schedule=r.sde_window_schedule, global_step=global_step, params=r.sde_window_params)


def finish_rollout(step: int, request: Batch, window: Window, batch: Batch, scores: dict, cfg,
                   seconds: dict[str, float], weights_step: int) -> Rollout:
    """Attach the request's metadata and uids and the rewards to a sampled batch; advantages."""
    batch.update(Batch(values={key: request[key] for key in ("metadata", "uids", "data_sources") if key in request}))
    start = time.perf_counter()
    batch["rewards"] = scores["overall"]
    batch["advantages"] = aggregate_advantages(scores, batch["uids"], cfg)
    seconds = {**seconds, "adv": time.perf_counter() - start}
    return Rollout(step, batch, scores, window, seconds, weights_step)


def score_samples(reward_fn, batch: Batch, request: Batch) -> dict[str, torch.Tensor]:
    """The run's rewards of a sampled batch, ranked within each row's uid (group-wise rewards),
    an edit's sources beside its images."""
    sources = batch.get("condition_images")
    return reward_fn(batch["images"], batch["prompts"], request["metadata"], groups=request["uids"],
                     **({"condition_images": sources} if sources is not None else {}))


def make_rollout(actor, reward_fn, prompts: list[str], metadata: list[dict], global_step: int, cfg,
                 uids=None, data_sources: list[str] | None = None, condition_images: list | None = None) -> Rollout:
    """The synchronous producer: sample with the actor's current weights, score, advantages;
    with `rollout.oversample`, first the pool that chooses which seeds are sampled."""
    timer = PhaseTimer()
    request, window = plan_rollout(prompts, metadata, global_step, cfg, uids, data_sources, condition_images)
    pool: dict = {}
    if cfg.rollout.oversample.enabled:
        request, pool = rank_pool(actor, reward_fn, request, global_step, cfg, timer)
    reward_start = time.time()
    if "batch" in pool:  # the kept pool samples are trained as they are
        batch, scores = pool["batch"], pool["scores"]
    else:
        with timer.phase("gen"):
            batch = actor.rollout(request["prompts"], request["seeds"], window=window,
                                  noise_seeds=request.get("noise_seeds"), policy=sampling_policy(cfg),
                                  condition_images=request.get("condition_images"))
        reward_start = time.time()
        with timer.phase("reward"):
            scores = score_samples(reward_fn, batch, request)
    batch.info.update(reward_start=reward_start, reward_end=time.time())  # wall clock, for timelines
    if pool:
        batch.info["producer_metrics"] = {**pool["metrics"],
                                          **({} if "batch" in pool else _proxy_fidelity(pool["proxy"], scores))}
    return finish_rollout(global_step, request, window, batch, scores, cfg, timer.seconds, global_step - 1)


def rank_pool(actor, reward_fn, candidates: Batch, global_step: int, cfg, timer: PhaseTimer) -> tuple[Batch, dict]:
    """Proxy-ranked oversampling: sample every candidate with the cheap deterministic sampler
    (`rollout.oversample`), score them, and keep rollout.n per prompt by the keep rule. Returns
    the kept candidates' request (their seeds give the training sampler the same initial noise)
    and what the pool showed: its metrics, the kept proxy rewards and, without regeneration, the
    kept samples and their scores to train on."""
    from pixelrl.sampling.oversampling import kept_positions
    from pixelrl.sampling.rollout import SamplingSettings

    r, over = cfg.rollout, cfg.rollout.oversample
    cheap = SamplingSettings(noise_level=0.0, guidance_scale=r.guidance_scale, logprob_reduction=r.logprob_reduction,
                             solver=over.solver, accelerator=r.accelerator, accelerator_params=dict(r.accelerator_params))
    with timer.phase("gen_pool"):
        sampled = actor.rollout(candidates["prompts"], candidates["seeds"], window=Window(0, 0), settings=cheap,
                                num_steps=over.num_steps or None, policy=sampling_policy(cfg),
                                condition_images=candidates.get("condition_images"))
    with timer.phase("reward_pool"):
        proxy = score_samples(reward_fn, sampled, candidates)
    generator = torch.Generator().manual_seed(derive_seed(step_seed(r.seed, global_step), "oversample_keep"))
    kept = kept_positions(proxy["overall"], candidates["uids"], r.n, over.keep, generator)
    pool = {"proxy": proxy["overall"][kept], "metrics": {
        "oversample/pool_reward_mean": float(proxy["overall"].mean()),
        "oversample/pool_group_std": group_reward_stats(proxy["overall"], candidates["uids"])["std_mean"],
        "oversample/kept_group_std": group_reward_stats(proxy["overall"][kept],
                                                        [candidates["uids"][i] for i in kept])["std_mean"]}}
    if not over.regenerate:
        pool.update(batch=sampled.select(kept), scores={name: values[kept] for name, values in proxy.items()})
    return candidates.select(kept), pool


def _proxy_fidelity(proxy: torch.Tensor, scores: dict) -> dict[str, float]:
    """How well the pool's ranking predicted the regenerated samples' rewards: the mean
    exact-minus-proxy reward and, where both vary, their Pearson correlation over the kept samples."""
    exact = scores["overall"].float()
    out = {"oversample/kept_reward_gap": float((exact - proxy.float()).mean())}
    if len(exact) > 1 and float(exact.std()) > 0 and float(proxy.float().std()) > 0:
        out["oversample/proxy_exact_corr"] = float(torch.corrcoef(torch.stack([proxy.float(), exact]))[0, 1])
    return out


# ---------------------------------------------------------------------------------- consumer
def without_zero_advantages(batch: Batch, step: int, cfg, num_workers: int) -> Batch:
    """The samples a step trains: all, or with `algorithm.drop_zero_advantage` those whose
    advantage is not exactly 0, refilled with random dropped ones to a multiple of mini-batches x
    workers (drawn from the step's seed, so a resumed run keeps the same ones)."""
    num_mini = mini_batches_per_epoch(cfg)
    train = batch
    if cfg.algorithm.drop_zero_advantage:
        generator = torch.Generator().manual_seed(derive_seed(step_seed(cfg.rollout.seed, step), "zero_advantage"))
        train = batch.select(zero_advantage_keep(batch["advantages"], num_mini * num_workers, generator))
    train.info["num_mini_batches"] = num_mini
    return train


def train_on_transitions(actor, rollout: Rollout, cfg, num_workers: int = 1, actor_version: int | None = None) -> dict[str, float]:
    """(timesteps to train) -> (drop zero advantages) -> (re-score old) -> (reference) -> update.

    `num_workers` is the size of the actor group, so that a reduced batch still splits evenly.
    `actor_version` is the actor's optimizer-step count: a batch sampled by an older version
    (asynchronous rollout) is re-scored under the current weights and importance-weighted
    (decoupled rollout correction), whatever `algorithm.rollout_correction` says.
    """
    timer = PhaseTimer()
    batch, r = rollout.batch, cfg.rollout
    seed = step_seed(r.seed, rollout.step)
    with timer.phase("adv"):
        if cfg.actor.timestep_fraction < 1.0 or cfg.actor.permute_timesteps:
            batch["train_step_index"] = trained_step_indices(
                rollout.window.size, len(batch), num_steps=r.num_steps, fraction=cfg.actor.timestep_fraction,
                permute=cfg.actor.permute_timesteps, seed=derive_seed(seed, "trained_steps"))
        train = without_zero_advantages(batch, rollout.step, cfg, num_workers)
    stale = actor_version is not None and batch.info.get("policy_version", actor_version) != actor_version
    correction_metrics: dict[str, float] = {}
    if cfg.algorithm.rollout_correction == "decoupled" or stale:
        with timer.phase("old_log_prob"):
            train.update(actor.score(train, "old"))
            a = cfg.algorithm
            criteria = a.rejection_criteria()
            train["is_weights"], step_mask, correction_metrics = rollout_correction(
                train["old_log_probs"], train["log_probs"], step_indices=train["step_indices"],
                is_level=a.rollout_is, is_threshold=a.rollout_is_threshold,
                is_batch_normalize=a.rollout_is_batch_normalize, criteria=criteria)
            if criteria:  # rejected sample-steps leave the loss mean, the KL and the metrics
                train["step_mask"] = step_mask
    if cfg.diffusion_loss.kl_coef > 0:
        with timer.phase("ref"):
            train.update(actor.score(train, "reference"))
    loss = LOSSES.get(cfg.diffusion_loss.name)
    # on-policy distillation: the teacher's replay, unless the rollout pool made it (rollout.scores_teacher)
    if loss.reads_teacher(loss.bind(cfg.diffusion_loss)) and "teacher_means" not in train:
        with timer.phase("teacher"):
            train.update(actor.score(train, "teacher"))
    with timer.phase("update_actor"):
        actor_metrics = actor.update(train)

    metrics = summary_metrics(rollout, actor_metrics, timer, num_workers)
    metrics["training/trained_fraction"] = len(train) / len(batch)
    metrics.update(correction_metrics)
    metrics["training/window_start"] = rollout.window.start
    metrics["training/window_size"] = rollout.window.size
    if actor_version is not None and "policy_version" in batch.info:
        metrics["training/policy_versions_behind"] = actor_version - batch.info["policy_version"]
    return metrics


def actor_step_metrics(actor_metrics: dict) -> dict[str, float]:
    """The actor's update metrics under `actor/`, except the engine's `perf/*` (MFU, FLOPs,
    forward and backward counts), which keep their own names."""
    return {(k if k.startswith("perf/") else f"actor/{k}"): v for k, v in actor_metrics.items()}


def summary_metrics(rollout: Rollout, actor_metrics: dict, timer: PhaseTimer, num_workers: int = 1) -> dict[str, float]:
    """Reward, advantage, actor and timing metrics of a step (names as verl-omni's). Timing
    sums the producer's phases (gen, reward, adv) and the consumer's. `perf/throughput` is
    images per second per actor worker (per device, as verl-omni counts it); `training/images`
    is the step's images over all workers."""
    batch, scores = rollout.batch, rollout.scores
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
    metrics.update(actor_step_metrics(actor_metrics))
    metrics.update(batch.info.get("producer_metrics", {}))
    counts = batch.info.get("accelerated") or {}
    if counts.get("forwards"):  # a lossy accelerator: the share of denoiser forwards it cut short (rank 0's)
        metrics["rollout/accelerator_skipped_fraction"] = counts["skipped"] / counts["forwards"]
    seconds = dict(rollout.seconds)
    for name, secs in timer.seconds.items():
        seconds[name] = seconds.get(name, 0.0) + secs
    total = sum(seconds.values())
    for name, secs in seconds.items():
        metrics[f"timing_s/{name}"] = secs
        metrics[f"timing_per_image_ms/{name}"] = 1000 * secs / num_images
    metrics["timing_s/step"] = total
    metrics["training/images"] = num_images
    metrics["perf/throughput"] = num_images / total / num_workers
    metrics["training/staleness"] = rollout.step - 1 - rollout.weights_step
    return metrics
