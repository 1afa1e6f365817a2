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
from pixelrl.core.config_loading import to_yaml
from pixelrl.data import shapes_qa
from pixelrl.engine.pretrain_vlm import evaluate_qa
from pixelrl.engine.vlm_engine import VLMEngine
from pixelrl.trainers.checkpointing import find_resume_folder, load_trainer_state, save_checkpoint
from pixelrl.trainers.policy_gradient import _every, run_dir_of
from pixelrl.trainers.tracking import Tracker

# RL draws its train items far from the ones supervised pretraining saw (which start at 0).
RL_ITEM_OFFSET = 10**8


def task_items(cfg: PixelRLConfig, split: str, start: int, count: int) -> list[dict]:
    if cfg.vlm.task == "shapes_qa":
        offset = RL_ITEM_OFFSET + cfg.data.seed * 10**7 if split == "train" else 0
        return shapes_qa.items(split, offset + start, count)
    from pixelrl.core.errors import ConfigError

    raise ConfigError("vlm.task", cfg.vlm.task, "choose shapes_qa")


class VLMPPOTrainer:
    def __init__(self, cfg: PixelRLConfig, console=print):
        self.cfg, self.cfg_yaml, self.console = cfg, to_yaml(cfg), console
        self.run_dir = run_dir_of(cfg)
        self.ckpt_root = self.run_dir / "checkpoints"

    def validate(self, engine: VLMEngine, step: int) -> dict[str, float]:
        items = task_items(self.cfg, "test", 0, self.cfg.vlm.val_items)
        result = evaluate_qa(engine.policy, items, max_new_tokens=self.cfg.vlm.max_new_tokens)
        return {f"val/{k}": v for k, v in result.items()}

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.cfg_yaml)
        total = t.total_training_steps
        engine = VLMEngine(cfg)
        start_step = 0
        resume = find_resume_folder(self.ckpt_root, t.resume_mode)
        if resume is not None:
            start_step, _ = load_trainer_state(resume)
            engine.load(resume / "actor")
            self.console(f"resumed from {resume} (global step {start_step})")
        tracker = Tracker(t.logger, self.run_dir, t.project_name, t.experiment_name, {}, console=self.console,
                          resumed_step=start_step if resume is not None else None)
        history, val_history = [], []
        spent = 0.0
        try:
            if t.val_before_train and start_step == 0:
                val = self.validate(engine, 0)
                tracker.log(val, 0)
                val_history.append(val)
            for step in range(start_step + 1, total + 1):
                began = time.perf_counter()
                items = task_items(cfg, "train", (step - 1) * cfg.data.train_batch_size, cfg.data.train_batch_size)
                exp, metrics = engine.make_experience(items, step)
                metrics["timing/experience_s"] = time.perf_counter() - began
                mid = time.perf_counter()
                metrics.update(engine.train_on(exp, step))
                metrics["timing/train_s"] = time.perf_counter() - mid
                spent += time.perf_counter() - began
                metrics["timing/step_s"] = time.perf_counter() - began
                last = step == total or (t.time_budget_s > 0 and spent >= t.time_budget_s)
                if _every(t.test_freq, step, last):
                    val = self.validate(engine, step)
                    metrics.update(val)
                    val_history.append(val)
                history.append(metrics)
                tracker.log(metrics, step)  # the row goes before its checkpoint
                if _every(t.save_freq, step, last):
                    save_checkpoint(self.ckpt_root, step, engine.save, {"step": step}, self.cfg_yaml,
                                    t.max_ckpt_to_keep)
                if last:
                    break
        finally:
            tracker.close()
        return {"history": history, "val": val_history, "run_dir": str(self.run_dir), "engine": engine}
