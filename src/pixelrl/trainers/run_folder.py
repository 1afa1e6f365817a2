"""One run per folder: a run holds an advisory lock on its folder for as long as it trains, and a
fresh start never writes over another run's checkpoints.

The lock is `flock` on `<run>/.pixelrl.lock`, which the kernel drops when the holding process
exits however it exits, so a killed run leaves no stale lock; the file names the holder (pid,
host, start time) for the message a second run gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.errors import ConfigError, PixelRLError

LOCK_NAME = ".pixelrl.lock"


def run_dir_of(cfg: PixelRLConfig) -> Path:
    t = cfg.trainer
    return Path(t.default_local_dir) / t.project_name / t.experiment_name


class RunFolderLock:
    """Taken just before a run first writes into its folder (so a run refused for bad input
    creates nothing) and released when the run ends; a second holder gets one error naming the
    first."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._handle = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.run_dir / LOCK_NAME, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ConfigError("trainer.default_local_dir", str(self.run_dir), f"another pixelrl run is training in "
                              f"this folder ({holder}): wait for it to end, or give this run its own "
                              "trainer.experiment_name") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the lock
            self._handle = None


def with_run_folder(run_dir: Path, train):
    """`train(lock)`, which takes the lock before its first write; released however it ends."""
    lock = RunFolderLock(run_dir)
    try:
        return train(lock)
    finally:
        lock.release()


def refuse_fresh_start_over_checkpoints(ckpt_root: Path, resume_mode: str) -> None:
    """`resume_mode: disable` in a folder that holds checkpoints would save over them one by one
    (and move the `latest` pointer back), leaving a mix of two runs."""
    if resume_mode != "disable":
        return
    held = sorted(p.name for p in ckpt_root.glob("global_step_*") if p.is_dir())
    if held:
        raise ConfigError("trainer.resume_mode", "disable", f"{ckpt_root} holds checkpoints of an earlier run "
                          f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}), which a fresh start would "
                          "overwrite: resume it (resume_mode=auto), give this run another trainer.experiment_name, "
                          "or delete that folder first")


def _logged_steps(run_dir: Path) -> int:
    """The last training step the run folder's metrics.jsonl records (0 without one)."""
    from pixelrl.trainers.tracking import read_metric_rows

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return max((int(row.get("step", 0)) for row in read_metric_rows(metrics)), default=0)


def start_over_notice(run_dir: Path) -> str | None:
    """What a run that finds no checkpoint to resume says when an earlier run left rows in its
    folder: it starts at step 1, and those rows are replaced (None: nothing to say)."""
    steps = _logged_steps(run_dir)
    if not steps:
        return None
    return (f"no checkpoint to resume in {run_dir / 'checkpoints'}: starting over at step 1; the earlier run's "
            f"metrics (to step {steps}) are replaced as these steps train again")


def interruption_summary(run_dir: Path, save_freq: int) -> str:
    """What an interrupted run keeps: the checkpoint a restart resumes from and the steps it will
    train again, or that no checkpoint exists and every step trained is lost."""
    from pixelrl.trainers.checkpointing import find_resume_folder

    steps = _logged_steps(run_dir)
    try:
        latest = find_resume_folder(run_dir / "checkpoints", "auto")
    except PixelRLError:  # a damaged pointer or trainer state: a restart says so itself
        latest = None
    if latest is None:
        when = {0: "saves only at the last step", -1: "never saves"}.get(save_freq, f"saves every {save_freq} steps")
        return (f"no checkpoint was written (trainer.save_freq={save_freq} {when}): the {steps} step(s) trained are "
                "lost, and a restart starts over at step 1")
    kept = int(latest.name.rsplit("_", 1)[-1])
    again = f"; steps {kept + 1}..{steps} will train again" if steps > kept else ""
    return f"the latest checkpoint is {latest} (step {kept} of the {steps} trained): a restart resumes there{again}"
