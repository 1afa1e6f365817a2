"""The vision-language PPO / GRPO trainer (`algorithm.trainer_type: vlm_ppo`).

The loop: items of the task -> `VLMEngine.make_experience` (sample, score, advantages) ->
`VLMEngine.train_on` (replayed for actor.ppo_epochs) -> metrics, validation, checkpoints.
GRPO is this trainer with a sequence estimator (group_norm, rloo, reinforce_baseline) and no
critic; `vlm.estimator: gae` adds the critic. Checkpoints hold actor, critic, EMA, optimizers,
schedulers and the KL controller; every random choice is keyed by the step, so resuming at step
k replays steps k+1.. exactly.
"""

from __future__ import annotations

import time

from pixelrl.core.config import PixelRLConfig
from pixelrl.core.config_loading import saved_yaml, to_yaml
from pixelrl.data import shapes_qa
from pixelrl.engine.pretrain_vlm import summarise_correctness
from pixelrl.trainers.checkpointing import (BestCheckpoint, check_resume_config, find_resume_folder, load_trainer_state,
                                           save_checkpoint)
from pixelrl.trainers.policy_gradient import _every, run_dir_of
from pixelrl.trainers.tracking import Tracker

# RL draws its train items far from the ones supervised pretraining saw (which start at 0).
RL_ITEM_OFFSET = 10**8


def task_items(cfg: PixelRLConfig, split: str, start: int, count: int) -> list[dict]:
    """Items `start .. start + count - 1` of `split` ("train", or "test" for validation)."""
    if cfg.vlm.task == "files":
        from pixelrl.data import qa_files

        rows = task_rows(cfg, split)
        if split == "train":
            return qa_files.train_items(rows, start, count, cfg.data.seed, cfg.data.shuffle)
        return [qa_files.load_item(row) for row in rows[start:start + count]]
    offset = RL_ITEM_OFFSET + cfg.data.seed * 10**7 if split == "train" else 0
    return shapes_qa.items(split, offset + start, count)


def task_rows(cfg: PixelRLConfig, split: str) -> tuple[dict, ...]:
    """The checked rows of `vlm.task: files` for `split` (train: data.train_files, else data.val_files)."""
    from pixelrl.data import qa_files

    field = "data.train_files" if split == "train" else "data.val_files"
    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    return qa_files.open_qa_files(tuple(str(f) for f in files), cfg.data.prompt_key, field)


def check_task_data(cfg: PixelRLConfig) -> None:
    """Open the dataset files on the driver, so a bad row or too few held-out rows stops the run
    before any worker starts."""
    from pixelrl.core.errors import ConfigError

    if cfg.vlm.task != "files":
        return
    task_rows(cfg, "train")
    t = cfg.trainer
    if t.val_before_train or t.test_freq != -1:
        held_out = len(task_rows(cfg, "test"))
        if cfg.vlm.val_items > held_out:
            raise ConfigError("vlm.val_items", cfg.vlm.val_items, f"data.val_files hold {held_out} rows: use at most "
                              f"that many (a multiple of trainer.n_workers={t.n_workers})")


class VLMPPOTrainer:
    def __init__(self, cfg: PixelRLConfig, console=print):
        self.cfg, self.cfg_yaml, self.console = cfg, to_yaml(cfg), console
        self.saved_yaml = saved_yaml(cfg)  # for files: no value taken from the environment
        self.run_dir = run_dir_of(cfg)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.actor = None
        self._ray_started = False

    def init_workers(self) -> None:
        from pixelrl.workers.group import LocalWorkerGroup, RayWorkerGroup, ensure_ray
        from pixelrl.workers.vlm_worker import VLMWorker

        t = self.cfg.trainer
        if t.backend == "ray":
            self._ray_started = ensure_ray(t)
            gpus = 1 if self.cfg.model.device.startswith("cuda") else 0
            self.actor = RayWorkerGroup(self.cfg_yaml, t.n_workers, t.num_cpus_per_worker, gpus, worker_cls=VLMWorker)
        else:
            self.actor = LocalWorkerGroup(self.cfg_yaml, worker_cls=VLMWorker)

    def shutdown(self) -> None:
        if self.actor is not None:
            try:
                self.actor.shutdown()
            except Exception:  # shutting down after a failure must not hide the failure
                pass
            self.actor = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def validate(self) -> dict[str, float]:
        shares = self.actor.call("validate", gather="all")
        result = summarise_correctness([r for share in shares for r in share])
        return {f"val/{k}": v for k, v in result.items()}

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        resume = find_resume_folder(self.ckpt_root, t.resume_mode)  # checked before anything starts
        if resume is not None:
            for warning in check_resume_config(resume, self.saved_yaml):
                self.console(warning)
        check_task_data(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.saved_yaml)
        total = t.total_training_steps
        try:
            self.init_workers()
            start_step = 0
            self.best = BestCheckpoint(self.ckpt_root, t.best_metric) if t.best_metric else None
            if resume is not None:
                start_step, _ = load_trainer_state(resume)
                self.actor.load(str(resume / "actor"))
                if self.best is not None:
                    self.best.restore(resume)
                self.console(f"resumed from {resume} (global step {start_step})")
            result = self._loop(start_step, total, resumed=resume is not None)
            if t.backend == "local":
                result["engine"] = self.actor.workers[0].engine
            else:
                result["states"] = self.actor.trainable_states()
            return result
        finally:
            self.shutdown()

    def _loop(self, start_step: int, total: int, *, resumed: bool) -> dict:
        t = self.cfg.trainer
        tracker = Tracker(t.logger, self.run_dir, t.project_name, t.experiment_name, {}, console=self.console,
                          resumed_step=start_step if resumed else None)
        history, val_history = [], []
        spent = 0.0
        try:
            if t.val_before_train and start_step == 0:
                val = self.validate()
                if self.best is not None:
                    self.best.offer(0, val)  # names a missing metric now, not after the first steps
                tracker.log(val, 0)
                val_history.append(val)
            for step in range(start_step + 1, total + 1):
                began = time.perf_counter()
                metrics = self.actor.call("train_step", None, step, gather="mean")
                spent += time.perf_counter() - began
                metrics["timing/step_s"] = time.perf_counter() - began
                last = step == total or (t.time_budget_s > 0 and spent >= t.time_budget_s)
                new_best = False
                if _every(t.test_freq, step, last):
                    val = self.validate()
                    metrics.update(val)
                    val_history.append(val)
                    new_best = self.best is not None and self.best.offer(step, val)
                history.append(metrics)
                tracker.log(metrics, step)  # the row goes before its checkpoint
                if _every(t.save_freq, step, last) or new_best:
                    save_checkpoint(self.ckpt_root, step, lambda folder: self.actor.save(str(folder)),
                                    {"step": step}, self.saved_yaml, t.max_ckpt_to_keep, best=self.best)
                if last:
                    break
        finally:
            tracker.close()
        return {"history": history, "val": val_history, "run_dir": str(self.run_dir)}
