"""Kills at random moments: `pixelrl train` in a subprocess, SIGKILLed (or interrupted) at a random
time, again and again until the run completes. After every kill: no process of the run survives,
the latest checkpoint is complete and loads, and no partial folder goes by a checkpoint's name.
Each completed run ends bitwise equal to an uninterrupted one, across epoch boundaries.

    pytest -m slow tests/test_crash_sweep.py -s     # prints the counts kept in docs/runtime.md
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from pixelrl.trainers.checkpointing import POINTER, STEP_DIR

# 3 epochs of 2 steps (4 prompts, 2 a step, reshuffled each epoch), a checkpoint every step
RUN = ("--config-name", "flow_grpo_tiny", "trainer.logger=[jsonl]", "data.train_batch_size=2",
       "data.prompts=[a red circle, two blue squares, a green tree, a yellow star]", "actor.ppo_mini_batch_size=4",
       "trainer.save_freq=1", "trainer.total_training_steps=0", "trainer.total_epochs=3", "trainer.num_cpus_per_worker=1")
RAY_DDP = ("trainer.backend=ray", "trainer.n_workers=2")
FINAL = "checkpoints/global_step_6/actor/trainable.safetensors"


def _launch(root: Path, model: Path, extra: tuple) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pixelrl", "train", *RUN, f"model.path={model}", f"trainer.default_local_dir={root}",
            *extra]
    # Ctrl-C in a terminal reaches a process whose SIGINT is at its default; an ignored SIGINT in
    # the test process (left by a library) would be inherited and the run would not stop.
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


class _Descendants:
    """Every process that descends from `pid` while it runs (polled), for the orphan check."""

    def __init__(self, pid: int):
        self.root, self.seen, self._stop = psutil.Process(pid), {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            try:
                for child in self.root.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    def names(self) -> list[str]:
        return [p.info["name"] for p in psutil.process_iter(["name"]) if p.pid in self.seen]

    def survivors(self, timeout_s: float = 20.0) -> list[str]:
        self._stop.set()
        self._thread.join()
        deadline = time.time() + timeout_s
        alive = list(self.seen.values())
        while alive and time.time() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.25)
        return [f"{p.pid} {p.name()}" for p in alive]


def run_and_kill(root: Path, model: Path, extra: tuple, after_s: float | None, sig=signal.SIGKILL,
                 wait_for: str | None = None) -> tuple[bool, int, list[str], str, float | None]:
    """Start a run; `after_s` seconds after it started (or after a process named `wait_for`
    appeared), send `sig`. Returns (killed, exit code, processes that survived, stderr, seconds
    until the run wrote its first metrics row, if it did)."""
    metrics = root / "pixelrl" / "flow_grpo_tiny" / "metrics.jsonl"
    rows_before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    proc = _launch(root, model, extra)
    tree = _Descendants(proc.pid)
    start = launched = time.time()
    if wait_for is not None:
        while proc.poll() is None and not any(wait_for in name for name in tree.names()):
            time.sleep(0.2)
        start = time.time()
    first_row = None
    while proc.poll() is None and (after_s is None or time.time() - start < after_s):
        if first_row is None and metrics.is_file() and len(metrics.read_text().splitlines()) > rows_before:
            first_row = time.time() - launched
        time.sleep(0.05)
    killed = after_s is not None and proc.poll() is None
    if killed:
        proc.send_signal(sig)
    _, err = proc.communicate()
    return killed, proc.returncode, tree.survivors(), err, first_row


def check_checkpoints(run: Path) -> int:
    """The pointer names a complete, loadable checkpoint; every `global_step_N` is complete.
    Returns the latest step (0 without a checkpoint)."""
    ckpts = run / "checkpoints"
    if not (ckpts / POINTER).is_file():
        assert not [p for p in ckpts.glob("*") if STEP_DIR.match(p.name)] if ckpts.is_dir() else True
        return 0
    step = int((ckpts / POINTER).read_text())
    for folder in ckpts.iterdir():
        if STEP_DIR.match(folder.name):
            state = json.loads((folder / "trainer_state.json").read_text())
            assert state["global_step"] == int(STEP_DIR.match(folder.name)[1])
            assert load_file(folder / "actor" / "trainable.safetensors")
            torch.load(folder / "data.pt", weights_only=True)
            assert (folder / "config.yaml").read_text()
    assert (ckpts / f"global_step_{step}").is_dir()
    return step


def _same_run(run: Path, straight: Path) -> bool:
    a, b = load_file(run / FINAL), load_file(straight / FINAL)
    rows = [[(m["step"], m["critic/rewards/mean"]) for m in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())]
            for r in (run, straight)]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and rows[0] == rows[1]


def sweep(tmp_path: Path, model: Path, extra: tuple, kills: int, seed: int) -> dict:
    """SIGKILL at random moments until `kills` kills landed; each run is resumed until it
    completes and compared with the uninterrupted run."""
    started = time.time()
    killed, code, survivors, err, first_row = run_and_kill(tmp_path / "straight", model, extra, None)
    duration = time.time() - started
    assert code == 0 and not survivors and first_row, err
    # kills land from shortly before the first step ends to the end of a whole run (start-up,
    # mostly imports and Ray, would otherwise take most of them)
    earliest = 0.8 * first_row
    straight = tmp_path / "straight" / "pixelrl" / "flow_grpo_tiny"
    rng, landed, exact, episode = random.Random(seed), 0, 0, 0
    while landed < kills:
        episode += 1
        root = tmp_path / f"episode_{episode}"
        run = root / "pixelrl" / "flow_grpo_tiny"
        while True:
            after = rng.uniform(earliest, duration) if landed < kills else None
            killed, code, survivors, err, _ = run_and_kill(root, model, extra, after)
            assert not survivors, f"kill {landed + 1}: survivors {survivors}"
            if killed:
                landed += 1
                assert code == -signal.SIGKILL, err
                check_checkpoints(run)
            else:
                assert code == 0, err
                assert check_checkpoints(run) == 6
                assert _same_run(run, straight), f"episode {episode} differs from the uninterrupted run"
                exact += 1
                break
    return {"kills": landed, "runs_resumed_to_the_end": episode, "exact": exact, "straight_s": round(duration, 1),
            "first_step_s": round(first_row, 1)}


@pytest.mark.slow  # ~30 s; the default run kills Ray workers too (test_runtime_ray.py, test_async.py kill -9)
def test_a_killed_or_interrupted_ray_run_leaves_no_process_behind(tmp_path, tiny_pixel_path):
    """SIGKILL of the driver while two Ray workers train (Ray's agents used to outlive it), then
    Ctrl-C of another run at the same moment: nothing of either run survives, and both checkpoints
    stay loadable. (The Ctrl-C run starts afresh: a resumed run can have so few steps left that it
    ends before the signal.)"""
    killed, code, survivors, err, _ = run_and_kill(tmp_path, tiny_pixel_path, RAY_DDP, 3.0, wait_for="PolicyWorker")
    assert killed and code == -signal.SIGKILL, err
    assert not survivors, survivors
    check_checkpoints(tmp_path / "pixelrl" / "flow_grpo_tiny")
    interrupted = tmp_path / "interrupted"
    killed, code, survivors, err, _ = run_and_kill(interrupted, tiny_pixel_path, RAY_DDP, 3.0, sig=signal.SIGINT,
                                                wait_for="PolicyWorker")
    assert killed and code == 130 and "Traceback" not in err, err
    assert not survivors, survivors
    check_checkpoints(interrupted / "pixelrl" / "flow_grpo_tiny")


@pytest.mark.slow
@pytest.mark.parametrize("layout, extra, kills", [("one process", ("trainer.backend=local",), 14),
                                                  ("2 Ray workers, DDP", RAY_DDP, 6),
                                                  ("2 Ray workers, FSDP2", (*RAY_DDP, "trainer.strategy=fsdp2"), 4)])
def test_random_sigkills_resume_bitwise_across_epochs(tmp_path, tiny_pixel_path, layout, extra, kills):
    counts = sweep(tmp_path, tiny_pixel_path, extra, kills, seed=len(layout))
    print(f"\n{layout}: {counts}")
    assert counts["kills"] == kills and counts["exact"] == counts["runs_resumed_to_the_end"]
