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

from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.config_io import saved_yaml, to_yaml
from pixelrl.vlm.qa_tasks import check_task_data, question_types
from pixelrl.vlm.pretrain import summarise_correctness
from pixelrl.trainers.checkpointing import (BestCheckpoint, check_resume_config, find_resume_folder, load_trainer_state,
                                           save_checkpoint)
from pixelrl.trainers.run_folder import (RunFolderLock, refuse_fresh_start_over_checkpoints, run_dir_of,
                                         start_over_notice, with_run_folder)
from pixelrl.trainers.schedule import Schedule, validation_or_error
from pixelrl.trainers.tracking import Tracker

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
        from pixelrl.vlm.worker import VLMWorker

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
        result = summarise_correctness([r for share in shares for r in share], question_types(self.cfg))
        return {f"val/{k}": v for k, v in result.items()}

    def fit(self) -> dict:
        return with_run_folder(self.run_dir, self._fit)  # the run folder is this process's while it trains

    def _fit(self, lock: RunFolderLock) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        refuse_fresh_start_over_checkpoints(self.ckpt_root, t.resume_mode)
        resume = find_resume_folder(self.ckpt_root, t.resume_mode)  # checked before anything starts
        if resume is not None:
            for warning in check_resume_config(resume, self.saved_yaml):
                self.console(warning)
        check_task_data(cfg)
        lock.acquire()  # before the first write, after every check that can refuse the run
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
            elif notice := start_over_notice(self.run_dir):  # an earlier run's rows, no checkpoint
                self.console(notice)
            result = self._loop(start_step, total)
            if t.backend == "local":
                result["engine"] = self.actor.workers[0].engine
            else:
                result["states"] = self.actor.trainable_states()
            return result
        finally:
            self.shutdown()

    def _loop(self, start_step: int, total: int) -> dict:
        t = self.cfg.trainer
        tracker = Tracker(t.logger, self.run_dir, t.project_name, t.experiment_name, {}, console=self.console,
                          resumed_step=start_step,  # rows past it (or all, from scratch) will run again
                          total_steps=total)
        history, val_history = [], []
        schedule = Schedule(t, total)
        try:
            if t.val_before_train and start_step == 0:
                val = self.validate()
                if self.best is not None:
                    self.best.offer(0, val)  # names a missing metric now, not after the first steps
                tracker.log(val, 0)
                val_history.append(val)
            for step in range(start_step + 1, total + 1):
                profiling = step == t.profile_step
                if profiling:
                    self.actor.call("start_profile", gather="all")
                began = time.perf_counter()
                metrics = self.actor.call("train_step", None, step, gather="mean")
                metrics["timing_s/step"] = time.perf_counter() - began
                if profiling:
                    self.actor.call("stop_profile", None, str(self.run_dir / "profile"), step, gather="all")
                    self.console(f"profile of step {step}: {self.run_dir / 'profile'}/step_{step}_rank_*.txt")
                last = schedule.finish_step(step, metrics["timing_s/step"])
                new_best, val_error = False, None
                if schedule.validates(step, last):
                    val, val_error = validation_or_error(self.validate)
                    metrics.update(val)
                    if val:
                        val_history.append(val)
                        new_best = self.best is not None and self.best.offer(step, val)
                history.append(metrics)
                tracker.log(metrics, step)  # the row goes before its checkpoint
                if schedule.saves(step, last, new_best, val_error):
                    save_checkpoint(self.ckpt_root, step, lambda folder: self.actor.save(str(folder)),
                                    {"step": step}, self.saved_yaml, t.max_ckpt_to_keep, best=self.best)
                if val_error is not None:
                    raise val_error
                if last:
                    break
        finally:
            tracker.close()
        return {"history": history, "val": val_history, "run_dir": str(self.run_dir)}
