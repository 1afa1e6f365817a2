"""`pixelrl train`'s outer loop: a run whose Ray worker dies (a native crash, the OOM killer, a lost
node) starts its workers again and resumes from its latest checkpoint, up to
`trainer.max_restarts` times. Resume is exact, so a restarted run ends where an uninterrupted one
would; the steps after the last checkpoint are trained again.

Only a process death restarts: an exception a worker raised (bad input, a bug) would repeat."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pixelrl.config.sections import SEPARATE_TRAINERS
from pixelrl.trainers.checkpointing import POINTER
from pixelrl.workers.group import WorkerDiedError


def trainer_class(cfg):
    if cfg.algorithm.trainer_type in SEPARATE_TRAINERS:  # a trainer with its own loop (the VLM's)
        return SEPARATE_TRAINERS.get(cfg.algorithm.trainer_type).trainer_class()
    from pixelrl.trainers.controller import DiffusionTrainer

    return DiffusionTrainer


def _pointer_state(root: Path) -> tuple | None:
    pointer = root / POINTER
    return (pointer.read_text(), pointer.stat().st_mtime_ns) if pointer.is_file() else None


def fit_with_restarts(cfg, console=print) -> dict:
    """The trainer's `fit()`, started again after a worker's process died, at most
    `cfg.trainer.max_restarts` times. Returns the last attempt's result."""
    restarts = 0
    while True:
        trainer = trainer_class(cfg)(cfg, console=console)
        before = _pointer_state(trainer.ckpt_root)
        try:
            return trainer.fit()
        except WorkerDiedError as err:
            if not err.process_died or restarts >= cfg.trainer.max_restarts:
                raise
            restarts += 1
            # resume from a checkpoint this attempt wrote; without one, start as this attempt did
            if _pointer_state(trainer.ckpt_root) != before:
                cfg = replace(cfg, trainer=replace(cfg.trainer, resume_mode="auto"))
                where = "its latest checkpoint"
            else:
                where = "where it started (no checkpoint written since)"
            console(f"restart {restarts} of {cfg.trainer.max_restarts}: {err}; starting the workers again "
                    f"from {where}")
