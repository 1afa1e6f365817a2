"""Run-level checkpoints: atomic folders, the `latest` pointer, rotation, resume.

    <run>/checkpoints/global_step_N/
        actor/                      engine state (see pixelrl.engine.checkpoint)
        data.pt                     data-loader state (weights_only-safe)
        trainer_state.json          global step
        config.yaml                 the resolved config
        rollout_queue/step_J.*      batches sampled ahead and not trained yet (async modes):
                                    tensors as safetensors, the rest as JSON
    <run>/checkpoints/latest_checkpointed_iteration.txt

A checkpoint is written into `global_step_N.tmp` and renamed when complete; the pointer is
rewritten (temp file + os.replace) only after that, so a crash at any moment leaves the
previous checkpoint as the latest valid one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from pixelrl.core.errors import ConfigError

POINTER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _before_commit(tmp_folder: Path) -> None:
    """Called after everything is written, before the rename (a seam for crash tests)."""


def save_checkpoint(root: Path, step: int, save_actor, loader_state: dict, config_yaml: str, max_keep: int = 0,
                    queued: list | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_actor(str(tmp / "actor"))
    torch.save(loader_state, tmp / "data.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (tmp / "config.yaml").write_text(config_yaml)
    if queued:
        save_rollouts(tmp / "rollout_queue", queued)
    _before_commit(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer_tmp = root / (POINTER + ".tmp")
    pointer_tmp.write_text(str(step))
    os.replace(pointer_tmp, root / POINTER)
    if max_keep > 0:
        for old in sorted(list_checkpoints(root))[:-max_keep]:
            shutil.rmtree(root / f"global_step_{old}", ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def find_resume_folder(root: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: none (`disable`), the pointer's (`auto`), or a given path."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        folder = Path(resume_mode)
        if not (folder / "trainer_state.json").is_file():
            raise ConfigError("trainer.resume_mode", resume_mode, "not a complete global_step_N checkpoint folder")
        return folder
    pointer = root / POINTER
    if not pointer.is_file():
        return None
    step = pointer.read_text().strip()
    folder = root / f"global_step_{step}"
    if not folder.is_dir():
        raise ConfigError("trainer.resume_mode", "auto",
                          f"{pointer} points at step {step} but {folder} is missing: fix the pointer or resume_mode=disable")
    return folder


def load_trainer_state(folder: Path) -> tuple[int, dict]:
    step = json.loads((folder / "trainer_state.json").read_text())["global_step"]
    loader_state = torch.load(folder / "data.pt", weights_only=True)
    return int(step), loader_state


def save_rollouts(folder: Path, rollouts: list) -> None:
    """Queued `Rollout`s: no pickle anywhere (tensors in safetensors, the rest in JSON)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for r in rollouts:
        # clones: `rewards` and the `overall` score are one tensor, and safetensors refuses shared memory
        tensors = {**{f"batch/{k}": t.clone() for k, t in r.batch.tensors.items()},
                   **{f"score/{k}": t.clone() for k, t in r.scores.items()}}
        save_file(tensors, str(folder / f"step_{r.step}.safetensors"))
        (folder / f"step_{r.step}.json").write_text(json.dumps({
            "step": r.step, "values": r.batch.values, "info": r.batch.info, "window": [r.window.start, r.window.end],
            "seconds": r.seconds, "weights_step": r.weights_step}))


def load_rollouts(folder: Path) -> list:
    from safetensors.torch import load_file

    from pixelrl.core.batch import Batch
    from pixelrl.sampling.windows import Window
    from pixelrl.trainers.step import Rollout

    if not folder.is_dir():
        return []
    rollouts = []
    for meta_path in folder.glob("step_*.json"):
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(meta_path.with_suffix(".safetensors")))
        batch = Batch({k[6:]: t for k, t in tensors.items() if k.startswith("batch/")}, meta["values"], meta["info"])
        batch.info["window"] = tuple(meta["info"]["window"])
        scores = {k[6:]: t for k, t in tensors.items() if k.startswith("score/")}
        rollouts.append(Rollout(meta["step"], batch, scores, Window(*meta["window"]), meta["seconds"],
                                meta["weights_step"]))
    return sorted(rollouts, key=lambda r: r.step)
