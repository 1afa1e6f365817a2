"""The controller, on Ray or in one process, for every diffusion method family.

The controller only orchestrates: it takes prompts from the loader and, each step, calls the
consumer of `algorithm.trainer_type` (`trainers/consumers.py`: the shared producer then the
update for the Flow-GRPO family and the forward-process methods, DMD2's cycle of attempts with no
producer) against the actor worker group and the reward group; and handles checkpoints,
validation, dumps and tracking. Workers compute.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pixelrl.config.auto_size import estimated_peak_gb
from pixelrl.config.sections import PixelRLConfig, validation_guidance
from pixelrl.core.config_io import saved_yaml, to_yaml
from pixelrl.data.prompts import PromptDataset, make_loader
from pixelrl.engine.evaluate import diversity
from pixelrl.engine.image_stats import StatisticsDrift, source_distance, x0_rms
from pixelrl.trainers.hacking import SUSPECTED, HackingMonitor, first_validation
from pixelrl.engine.preflight import preflight_warnings
from pixelrl.rewards.multi import WeightedReward
from pixelrl.sampling.rollout import SamplingSettings
from pixelrl.sampling.sde import sde_rule
from pixelrl.sampling.windows import Window, full_window
from pixelrl.core.errors import ConfigError, RewardError
from pixelrl.trainers.ahead import AheadProducer
from pixelrl.trainers import distribution_matching, forward_process  # noqa: F401  (register their consumers)
from pixelrl.trainers.consumers import CONSUMERS, StepContext
from pixelrl.trainers.datasets import datasets_of
from pixelrl.trainers.checkpointing import (BestCheckpoint, check_resume_config, find_resume_folder, load_rollouts,
                                           load_trainer_state, save_checkpoint)
from pixelrl.trainers.run_folder import (RunFolderLock, refuse_fresh_start_over_checkpoints, run_dir_of,
                                         start_over_notice, with_run_folder)
from pixelrl.trainers.schedule import Schedule, validation_or_error
from pixelrl.trainers.tracking import Tracker, image_grid, read_metric_rows

VAL_SEED_BASE = 1_000_000_007  # validation images use fixed seeds, so every validation is comparable


def scored_in_parts(reward, parts: list, rows: list[dict], sources: list | None) -> dict[str, torch.Tensor]:
    """`reward`'s scores of every row, called once per part (row indices, their images): the
    validation images of one size at a time."""
    scores: dict[str, torch.Tensor] = {}
    for indices, images in parts:
        picked = [rows[i] for i in indices]
        extra = {"condition_images": [sources[i] for i in indices]} if sources is not None else {}
        part = reward(images, [r["prompt"] for r in picked], [r["metadata"] for r in picked], **extra)
        for key, values in part.items():
            scores.setdefault(key, torch.zeros(len(rows), dtype=values.dtype))[torch.tensor(indices)] = values
    return scores


def validation_policy(cfg: PixelRLConfig) -> str:
    """The weights validation samples with (`val_kwargs.weights`): the old adapter, or the EMA of
    the trained weights when the run keeps one (flow_grpo and DiffusionNFT validate it), or them."""
    if cfg.val_kwargs.weights == "old":
        return "old"
    return "ema" if cfg.actor.ema_decay > 0 else "current"


def mean_over_sources(metrics: dict[str, float], sources: list[str]) -> dict[str, float]:
    """`val-*/overall/...`: each per-source validation metric averaged over the data sources
    (GenEval's overall score is the mean over its categories). Nothing for a single source."""
    if len(sources) < 2:
        return {}
    grouped: dict[str, list[float]] = defaultdict(list)
    for source in sources:
        for head in ("val-core", "val-aux"):
            prefix = f"{head}/{source}/"
            for key, value in metrics.items():
                if key.startswith(prefix):
                    grouped[f"{head}/overall/{key[len(prefix):]}"].append(value)
    return {key: float(np.mean(values)) for key, values in grouped.items()}


def validation_settings(cfg: PixelRLConfig) -> SamplingSettings:
    """How validation samples: `val_kwargs.solver` (Euler steps at `val_kwargs.noise_level`, 0: the
    ODE, by default) whatever the rollouts' solver, as the references evaluate (AWM trains on
    SA-Solver samples and evaluates with the deterministic Euler step at 40 steps; DGPO evaluates
    with its DPM-Solver at 14)."""
    vk = cfg.val_kwargs
    # an `ode` rollout stores its deterministic steps for training; validation stores nothing and
    # takes its own noise level with the SDE step
    sde_type = "sde" if sde_rule(cfg.rollout.sde_type).deterministic else cfg.rollout.sde_type
    return SamplingSettings(noise_level=vk.noise_level, sde_type=sde_type, solver=vk.solver,
                            guidance_scale=validation_guidance(cfg), logprob_reduction=cfg.rollout.logprob_reduction)


class RewardErrorPolicy:
    """What a failing scorer does to the run (`reward.on_error`): `stop` raises at once, naming the
    option; `skip` drops that step's update (or that validation's scores) and goes on, until
    `limit` training steps in a row have failed."""

    def __init__(self, mode: str, limit: int, console):
        self.mode, self.limit, self.console = mode, limit, console
        self.in_a_row, self.last_error = 0, None

    def failed(self, step: int, err: RewardError) -> None:
        """Raise under `stop`; under `skip`, count the failure and say so."""
        if self.mode != "skip":
            raise RewardError(f"step {step}: {err}. To skip the steps whose reward fails instead of stopping, "
                              "set reward.on_error=skip") from None
        self.in_a_row += 1
        self.last_error = err
        self.console(f"step {step}: reward failed ({err}); step skipped, no update ({self.in_a_row} in a row)")

    def succeeded(self) -> None:
        self.in_a_row = 0

    def stop_if_too_many(self) -> None:
        if self.in_a_row >= self.limit:
            raise RewardError(f"the reward failed {self.in_a_row} steps in a row (last: {self.last_error}); "
                              f"stopping at reward.max_consecutive_errors={self.limit}: fix the scorer and resume")

    def guard(self, step: int, validate) -> dict:
        """Validation scores, or none (with a console line) when its reward fails under `skip`."""
        try:
            return validate()
        except RewardError as err:
            if self.mode != "skip":
                raise
            self.console(f"step {step}: reward failed during validation ({err}); validation skipped")
            return {}


class DiffusionTrainer:
    def __init__(self, cfg: PixelRLConfig, console=print):
        self.cfg = cfg
        self.console = console
        self.run_dir = run_dir_of(cfg)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.cfg_yaml = to_yaml(cfg)  # for the workers
        self.saved_yaml = saved_yaml(cfg)  # for files and trackers: no value taken from the environment
        self.actor = self.rewards = self.pool = None
        self._ray_started = False
        self.reward_errors = RewardErrorPolicy(cfg.reward.on_error, cfg.reward.max_consecutive_errors, console)
        self.image_drift = StatisticsDrift()  # the image statistics of each validation, and their drift
        self.hacking = HackingMonitor(cfg.val_kwargs.hacking, cfg.val_kwargs.n,
                                      [f["name"] for f in cfg.val_kwargs.rewards], console)
        self._gold = WeightedReward.from_functions([dict(f) for f in cfg.val_kwargs.rewards], cfg.reward.timeout_s) \
            if cfg.val_kwargs.rewards else None
        # on a GPU, the memory estimate the `auto` sizes rely on, logged beside the measured peak
        self._estimated_peak_gb = estimated_peak_gb(cfg) if cfg.model.device.startswith("cuda") else None

    # ------------------------------------------------------------------ set-up
    def init_workers(self) -> None:
        from pixelrl.workers.group import LocalWorkerGroup, RayWorkerGroup, RewardGroup, ensure_ray

        t, r, ro = self.cfg.trainer, self.cfg.reward, self.cfg.rollout
        if t.backend == "ray":
            self._ray_started = ensure_ray(t, ro.n_workers * ro.num_cpus_per_worker) or self._ray_started
            gpus = 1 if self.cfg.model.device.startswith("cuda") else 0
            self.actor = RayWorkerGroup(self.cfg_yaml, t.n_workers, t.num_cpus_per_worker, gpus,
                                        sequence_size=t.sequence_parallel_size)
            if ro.n_workers:
                self.pool = RayWorkerGroup(self.cfg_yaml, ro.n_workers, ro.num_cpus_per_worker, gpus, role="rollout")
        else:
            self.actor = LocalWorkerGroup(self.cfg_yaml)
            if ro.n_workers:
                self.pool = LocalWorkerGroup(self.cfg_yaml, role="rollout", size=ro.n_workers)
        self.rewards = RewardGroup([dict(f) for f in r.functions], backend=t.backend, placement=r.placement,
                                   num_workers=r.num_workers, num_cpus=r.num_cpus, num_gpus=r.num_gpus,
                                   plugins=self.cfg.plugins, timeout_s=r.timeout_s)

    def shutdown(self) -> None:
        for group in (self.actor, self.pool, self.rewards):
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # shutting down after a failure must not hide the failure
                    pass
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train; returns {"history": [per-step metrics], "val": [validation metrics]}. The run
        folder is this process's while it trains."""
        return with_run_folder(self.run_dir, self._fit)

    def _fit(self, lock: RunFolderLock) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        # before anything is written or started: a checkpoint made for another model or batch stops here
        refuse_fresh_start_over_checkpoints(self.ckpt_root, t.resume_mode)
        resume = find_resume_folder(self.ckpt_root, t.resume_mode)
        if resume is not None:
            for warning in check_resume_config(resume, self.saved_yaml):
                self.console(warning)
        train_set, val_set = datasets_of(self.cfg)
        if t.best_metric and val_set is None:
            raise ConfigError("trainer.best_metric", t.best_metric, "the run has no validation prompts to pick a "
                              "checkpoint by: set data.val_files (or use a prompt set with a validation split)")
        if t.stop_when_hacking and val_set is None:
            raise ConfigError("trainer.stop_when_hacking", True, "the run has no validation prompts to watch: set "
                              "data.val_files (or use a prompt set with a validation split)")
        lock.acquire()  # before the first write, after every check that can refuse the run
        from pixelrl.config.plan import reward_names

        self.console(f"training {cfg.diffusion_loss.name} ({cfg.algorithm.trainer_type}) on {cfg.model.path}, reward: "
                     f"{reward_names(cfg)}; run folder {self.run_dir}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.saved_yaml)
        # prompt rows, preference pairs or demonstrations: each dataset says how its rows batch
        loader = make_loader(train_set, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                             drop_last=True, collate_fn=train_set.collate, buckets=train_set.loader_buckets())
        total = t.total_training_steps or len(loader) * t.total_epochs
        self.best = BestCheckpoint(self.ckpt_root, t.best_metric) if t.best_metric else None
        try:
            self.init_workers()
            start_step, queued = 0, []
            self.actor_version = 0  # the actor's optimizer steps: a batch from an older one is stale
            if resume is not None:
                start_step, loader_state = load_trainer_state(resume)
                loader.load_state_dict(loader_state)
                self.actor_version = self.actor.load(str(resume / "actor"))["policy_version"]
                queued = load_rollouts(resume / "rollout_queue")
                if self.best is not None:
                    self.best.restore(resume)
                self.console(f"resumed from {resume} (global step {start_step})")
                self._seed_first_validation(start_step)
            elif notice := start_over_notice(self.run_dir):  # an earlier run's rows, no checkpoint
                self.console(notice)
            from omegaconf import OmegaConf

            tracker = Tracker(t.logger, self.run_dir, t.project_name, t.experiment_name,
                              OmegaConf.to_container(OmegaConf.create(self.saved_yaml)), console=self.console,
                              resumed_step=start_step,  # rows past it (or all, from scratch) will run again
                              total_steps=total, time_budget_s=t.time_budget_s)
            history, val_history = [], []
            try:
                if t.val_before_train and val_set is not None and start_step == 0:
                    val_metrics = self.reward_errors.guard(0, lambda: self.validate(val_set, 0, tracker))
                    if val_metrics and self.best is not None:
                        self.best.offer(0, val_metrics)  # names a missing metric now, not after the first steps
                    if val_metrics:
                        tracker.log(val_metrics, 0)
                        val_history.append(val_metrics)
                history, val_history = self._loop(loader, start_step, total, val_set, tracker, history, val_history,
                                                  queued)
            finally:
                tracker.close()
            return {"history": history, "val": val_history, "run_dir": str(self.run_dir)}
        finally:
            self.shutdown()

    def _loop(self, loader, start_step, total, val_set, tracker, history, val_history, queued):
        from tqdm import tqdm

        cfg, t = self.cfg, self.cfg.trainer
        consume = CONSUMERS.get(cfg.algorithm.trainer_type)  # one per method family, one signature
        data_iter = iter(loader)

        def next_rows():
            nonlocal data_iter
            try:
                return next(data_iter)
            except StopIteration:  # next epoch (the sampler reshuffles with seed + epoch)
                data_iter = iter(loader)
                return next(data_iter)

        ahead = None
        if self.pool is not None:
            ahead = AheadProducer(self.pool, self.actor, self.rewards, cfg, next_rows)
            ahead.start(start_step + 1, queued)
        elif queued:
            raise ConfigError("trainer.mode", t.mode, "the checkpoint holds batches sampled ahead by a rollout pool: "
                              "resume with the rollout.n_workers and trainer.mode it was saved with")
        schedule = Schedule(t, total)
        if t.time_budget_s:  # said now, not only when it stops the run
            self.console(f"time budget: {t.time_budget_s:.0f} s of training steps (trainer.time_budget_s): the run "
                         f"stops after the step that uses it up, whatever of its {total} steps remain")
        progress = tqdm(total=total, initial=start_step, desc="training", unit="step", dynamic_ncols=True,
                        disable=not os.isatty(2))
        reward_errors = self.reward_errors
        for step in range(start_step + 1, total + 1):
            profiling = step == t.profile_step
            if profiling:
                self.actor.call("start_profile", gather="all")
            batch, metrics = consume(StepContext(self.actor, self.rewards, cfg, step, total, next_rows, ahead,
                                                 self.actor_version, reward_errors, self._estimated_peak_gb))
            if "actor/policy_version" in metrics:  # the step's update ran (a skipped step has none)
                self.actor_version = int(metrics["actor/policy_version"])
            for line in preflight_warnings(metrics):  # the updates stopped following the gradients
                self.console(f"step {step}: {line}")
            if profiling:
                self.actor.call("stop_profile", None, str(self.run_dir / "profile"), step, gather="all")
                self.console(f"profile of step {step}: {self.run_dir / 'profile'}/step_{step}_rank_*.txt")
            if cfg.val_kwargs.gold_on_rollouts and batch is not None and "images" in batch:
                metrics.update(self._gold_on_rollout(batch))
            metrics["training/global_step"] = step
            metrics["training/epoch"] = loader.sampler.epoch
            last = schedule.finish_step(step, metrics["timing_s/step"])
            if schedule.dumps_rollouts(batch is not None):
                self._dump(Path(t.rollout_data_dir) / f"step_{step:06d}", batch)
            if schedule.draws_grid(step, batch is not None):
                self._grid(tracker, "train/samples", batch, step)
            new_best, val_error, val_metrics = False, None, {}
            if val_set is not None and schedule.validates(step, last):
                val_metrics, val_error = validation_or_error(
                    lambda: reward_errors.guard(step, lambda: self.validate(val_set, step, tracker)))
                metrics.update(val_metrics)
                if val_metrics:
                    val_history.append(val_metrics)
                    new_best = self.best is not None and self.best.offer(step, val_metrics)
            hacked = bool(val_metrics.get(SUSPECTED))
            if hacked:
                self.console(f"step {step}: reward hacking suspected (val_kwargs.hacking): {self.hacking.summary()}")
            # the row first: a kill between the two re-runs the step and replaces the row on resume;
            # the other order would lose it for good
            tracker.log(metrics, step)
            history.append(metrics)
            reward_errors.stop_if_too_many()  # after the row (it shows the failure), before the checkpoint
            stop = hacked and t.stop_when_hacking
            if schedule.saves(step, last, new_best, val_error, stop):
                save_checkpoint(self.ckpt_root, step, self.actor.save, loader.state_dict(), self.saved_yaml,
                                t.max_ckpt_to_keep, queued=ahead.queued() if ahead is not None else None,
                                best=self.best)
            if val_error is not None:
                raise val_error
            progress.update(1)
            if "critic/rewards/mean" in metrics:
                progress.set_postfix(reward=f"{metrics['critic/rewards/mean']:.4f}")
            if stop:
                saved = ("; its checkpoint resumes the run" if t.save_freq != -1
                         else " (trainer.save_freq=-1: no checkpoint)")
                self.console(f"stopping after step {step} (trainer.stop_when_hacking): look at its validation images "
                             f"before training on{saved}")
                break
            if schedule.out_of_time:
                self.console(f"time budget of {t.time_budget_s:.0f} s used after step {step}: stopping")
                break
        progress.close()
        return history, val_history

    # ------------------------------------------------------------------ validation
    def _gold_on_rollout(self, batch) -> dict[str, float]:
        """`critic/gold/<key>/mean`: the gold rewards' means over the step's rollout images."""
        scores = self._gold(batch["images"], list(batch["prompts"]), list(batch["metadata"]),
                            groups=list(batch["uids"]) if "uids" in batch else None)
        return {f"critic/gold/{key}/mean": float(values.float().mean()) for key, values in scores.items()
                if key != "overall"}

    def _seed_first_validation(self, start_step: int) -> None:
        """A resumed run compares its validations with the run's first one, read back from its rows."""
        rows_file = self.run_dir / "metrics.jsonl"
        first = first_validation(read_metric_rows(rows_file), start_step) if rows_file.exists() else None
        self.hacking.seed(first)
        self.image_drift.seed(first)

    def validate(self, val_set: PromptDataset, step: int, tracker: Tracker) -> dict[str, float]:
        """Generate `val_kwargs.n` images per validation prompt with fixed seeds and score them."""
        cfg, vk = self.cfg, self.cfg.val_kwargs
        rows = [val_set[i] for i in range(len(val_set))] * vk.n
        seeds = [VAL_SEED_BASE + i for i in range(len(rows))]
        sources = [r["condition_images"] for r in rows] if any("condition_images" in r for r in rows) else None
        # rows of one number and size of condition pictures at a time (a call stacks their latents);
        # each row keeps its seed, so the images do not depend on how the rows are grouped
        by_shape = defaultdict(list)
        for i, r in enumerate(rows):
            by_shape[tuple(tuple(c.shape) for c in r.get("condition_images", ()))].append(i)
        generated = [(indices, *self._validation_images([rows[i] for i in indices], [seeds[i] for i in indices]))
                     for indices in by_shape.values()]
        parts = [(indices, part) for indices, part, _ in generated]
        samples = {"x0_rms": float(torch.cat([rms for _, _, rms in generated]).mean())}
        if len({tuple(part.shape[1:]) for _, part in parts}) == 1:
            images = parts[0][1].new_zeros((len(rows), *parts[0][1].shape[1:]))
            for indices, part in parts:
                images[torch.tensor(indices)] = part
            parts = [(list(range(len(rows))), images)]
        else:  # edits in their sources' aspects (rollout.output_aspect=source): one image per row
            images = [None] * len(rows)
            for indices, part in parts:
                for i, image in zip(indices, part):
                    images[i] = image
        scores = scored_in_parts(self.rewards, parts, rows, sources)
        overall = scores["overall"]
        # gold rewards are judged here, in the driver, on the same images
        gold = scored_in_parts(self._gold, parts, rows, None) if vk.rewards else {}
        by_source = defaultdict(list)
        for i, r in enumerate(rows):
            by_source[r["data_source"]].append(i)
        metrics: dict[str, float] = {}
        per_prompt = len(val_set)
        for source, idx in by_source.items():
            values = overall[idx]
            metrics[f"val-core/{source}/reward/mean@{vk.n}"] = float(values.mean())
            if vk.n > 1:  # best@n: the best of the n images of each prompt, averaged over prompts
                grouped = defaultdict(list)
                for i in idx:
                    grouped[i % per_prompt].append(float(overall[i]))
                metrics[f"val-core/{source}/reward/best@{vk.n}"] = float(np.mean([max(v) for v in grouped.values()]))
            for name, values_all in scores.items():
                if name != "overall":
                    metrics[f"val-aux/{source}/{name}/mean@{vk.n}"] = float(values_all[idx].mean())
            for name, values_all in gold.items():
                if name != "overall":
                    metrics[f"val-core/{source}/gold/{name}/mean@{vk.n}"] = float(values_all[idx].mean())
            if vk.n > 1:  # how different the n images of one prompt are (mean pairwise L1, 0..1)
                items = [{**rows[i], "group": i % per_prompt} if sources is not None else rows[i] for i in idx]
                metrics[f"val-core/{source}/diversity@{vk.n}"] = diversity([images[i] for i in idx], items)["pairwise_l1"]
        metrics.update(mean_over_sources(metrics, list(by_source)))
        if sources is not None:
            samples["source_distance"] = source_distance(images, sources)
        # what no reward looks at (engine/image_stats.py)
        metrics.update(self.image_drift.metrics(images, samples))
        metrics.update(self.hacking.metrics(metrics, step))  # against the first validation (trainers/hacking.py)
        folder = Path(cfg.trainer.validation_data_dir or self.run_dir / "validation") / f"step_{step:06d}"
        self._dump(folder, None, images=images, prompts=[r["prompt"] for r in rows], scores=scores, seeds=seeds)
        self._grid(tracker, "val/samples", None, step, images=images[:32],
                   captions=[f"{float(overall[i]):.3f} {rows[i]['prompt']}" for i in range(min(32, len(rows)))])
        return metrics

    def _validation_images(self, rows: list[dict], seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The validation sampler's images of `rows` (one number of condition pictures), one per
        row with its seed, and each one's x0_rms (its clean sample's size before decoding)."""
        cfg, vk = self.cfg, self.cfg.val_kwargs
        real = len(rows)
        pad = (-real) % self.actor.data_size  # pad to a multiple of the data workers; padding is dropped
        rows = (rows * (pad // real + 2))[:real + pad]  # cycles when there are fewer rows than workers
        seeds = seeds + [seeds[-1] + 1 + k for k in range(pad)]  # the padding's own seeds, as a whole set's
        prompts = [r["prompt"] for r in rows]
        sources = [r["condition_images"] for r in rows] if "condition_images" in rows[0] else None
        settings = validation_settings(cfg)
        window = full_window(vk.num_steps) if settings.stores_transitions else Window(0, 0)
        # val_batch_size prompts per generation call (rounded up to a multiple of the workers)
        chunk = len(rows) if not cfg.data.val_batch_size else -(-cfg.data.val_batch_size // self.actor.data_size) * self.actor.data_size
        outs = [self.actor.rollout(prompts[i:i + chunk], seeds[i:i + chunk], window=window, settings=settings,
                                   num_steps=vk.num_steps, policy=validation_policy(cfg),
                                   condition_images=None if sources is None else sources[i:i + chunk])
                for i in range(0, len(rows), chunk)]
        return torch.cat([o["images"] for o in outs])[:real], torch.cat([x0_rms(o["x0"]) for o in outs])[:real]

    # ------------------------------------------------------------------ outputs
    def _dump(self, folder: Path, batch, *, images=None, prompts=None, scores=None, seeds=None) -> None:
        """JSONL of prompts, seeds and scores plus one PNG per image (an animated GIF per video)."""
        folder.mkdir(parents=True, exist_ok=True)
        if batch is not None:
            images, prompts, seeds = batch["images"], batch["prompts"], batch["seeds"]
            scores = {"reward": batch["rewards"], "advantage": batch["advantages"]}
            # how the batch was sampled: policy version, window, sampler settings
            (folder / "info.json").write_text(json.dumps(batch.info, indent=1, default=str))
        with (folder / "samples.jsonl").open("w") as handle:
            for i, prompt in enumerate(prompts):
                record = {"index": i, "prompt": prompt, "seed": int(seeds[i]),
                          **{k: float(v[i]) for k, v in scores.items()}}
                handle.write(json.dumps(record) + "\n")
                sample = images[i].numpy()
                if sample.ndim == 4:  # a video: its frames as an animated GIF
                    frames = [Image.fromarray(frame) for frame in sample]
                    frames[0].save(folder / f"{i:05d}.gif", save_all=True, append_images=frames[1:], duration=125,
                                   loop=0)
                else:
                    Image.fromarray(sample).save(folder / f"{i:05d}.png")

    def _grid(self, tracker, tag, batch, step, *, images=None, captions=None) -> None:
        if batch is not None:
            images = batch["images"][:32]
            captions = [f"{float(batch['rewards'][i]):.3f} {batch['prompts'][i]}" for i in range(len(images))]
        if isinstance(images, list):  # edits of several sizes: each on a white canvas of the largest
            height, width = max(image.shape[0] for image in images), max(image.shape[1] for image in images)
            canvas = torch.full((len(images), height, width, 3), 255, dtype=torch.uint8)
            for i, image in enumerate(images):
                canvas[i, :image.shape[0], :image.shape[1]] = image
            images = canvas
        tracker.log_images(tag, image_grid(images.numpy(), captions), step)
