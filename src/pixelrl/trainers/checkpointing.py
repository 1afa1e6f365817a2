"""Run-level checkpoints: atomic folders, the `latest` pointer, rotation, resume, and loading a
checkpoint's model for evaluation (`load_for_eval`).

    <run>/checkpoints/global_step_N/
        actor/                      engine state (see pixelrl.engine.checkpoint)
        data.pt                     data-loader state (weights_only-safe)
        trainer_state.json          global step (and the best checkpoint so far, with trainer.best_metric)
        config.yaml                 the resolved config
        rollout_queue/step_J.*      batches sampled ahead and not trained yet (async modes):
                                    tensors as safetensors, the rest as JSON
    <run>/checkpoints/latest_checkpointed_iteration.txt
    <run>/checkpoints/best_checkpoint.json      with trainer.best_metric: {"metric", "step", "value", "folder"}

A checkpoint is written into `global_step_N.tmp`, every file and folder of it fsync'ed, and
renamed when complete; the pointer is rewritten (temp file + fsync + os.replace) only after
that, so a crash or a power loss at any moment leaves the previous checkpoint as the latest
valid one. A folder is never deleted in place: it is first renamed to `global_step_N.deleting`
(which nothing reads), so a kill mid-deletion never leaves a half-deleted `global_step_N`;
leftovers of either kind are removed by the next save. Re-saving a step moves the old folder
aside only once the new one is complete. Rotation (`max_keep`) removes only checkpoints older
than the one just written, never that one, nor the best one (`BestCheckpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from pixelrl.config.sections import RESUME_CHANGEABLE
from pixelrl.core.errors import ConfigError
from pixelrl.engine.checkpoint import CheckpointError

POINTER = "latest_checkpointed_iteration.txt"
BEST_POINTER = "best_checkpoint.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _before_commit(tmp_folder: Path) -> None:
    """Called after everything is written, before the rename (a seam for crash tests)."""


def save_checkpoint(root: Path, step: int, save_actor, loader_state: dict, config_yaml: str, max_keep: int = 0,
                    queued: list | None = None, best: BestCheckpoint | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for leftover in [*root.glob("global_step_*.tmp"), *root.glob("global_step_*.deleting")]:
        shutil.rmtree(leftover, ignore_errors=True)  # an interrupted save or deletion
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    _check_space(root, step)
    tmp.mkdir()
    try:
        save_actor(str(tmp / "actor"))
        torch.save(loader_state, tmp / "data.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        if queued:
            save_rollouts(tmp / "rollout_queue", queued)
        state = {"global_step": step, **({"best": best.state()} if best is not None else {})}
        (tmp / "trainer_state.json").write_text(json.dumps(state))  # last: marks it complete
        _before_commit(tmp)
        sync_tree(tmp)
    except Exception as err:  # (a kill is not an Exception: its .tmp stays for the next save to clear)
        shutil.rmtree(tmp, ignore_errors=True)  # give back what the partial write took
        if _out_of_space(err, root):
            raise CheckpointError(f"no space left on the device of {root} while writing the step-{step} checkpoint "
                                  f"({_free_mb(root):.0f} MB free now){_keeps(root)}: free space, lower "
                                  "trainer.max_ckpt_to_keep or point trainer.default_local_dir elsewhere, then "
                                  "resume") from None
        raise
    if final.exists():  # re-saving a step: the old folder goes only now that the new one is complete
        _delete(final)
    os.replace(tmp, final)
    _sync(root)
    pointer_tmp = root / (POINTER + ".tmp")
    pointer_tmp.write_text(str(step))
    _sync(pointer_tmp)
    os.replace(pointer_tmp, root / POINTER)
    _sync(root)
    if best is not None:
        best.write_pointer()
    if max_keep > 0:
        older = [s for s in list_checkpoints(root) if s < step and (best is None or s != best.step)]
        for old in older[:max(0, len(older) - (max_keep - 1))]:
            _delete(root / f"global_step_{old}")
    return final


class BestCheckpoint:
    """`trainer.best_metric`: the checkpoint of the validation at which that metric was highest.
    A validation that beats every earlier one (step >= 1; the base model has no checkpoint) saves
    a checkpoint even off `save_freq`; rotation never deletes it; `best_checkpoint.json` names it.
    The best so far is part of each checkpoint's trainer state, so a resumed run goes on comparing
    against the best it had reached at that checkpoint."""

    def __init__(self, root: Path, metric: str):
        self.root, self.metric = root, metric
        self.step: int | None = None
        self.value: float | None = None

    def offer(self, step: int, val_metrics: dict) -> bool:
        """True (and this becomes the best) when `val_metrics` beats every earlier validation."""
        if self.metric not in val_metrics:
            names = sorted(k for k in val_metrics if k.startswith("val"))
            raise ConfigError("trainer.best_metric", self.metric, "the validation logged no metric of that name: use "
                              f"one of {names[:12]}{' ...' if len(names) > 12 else ''}")
        value = float(val_metrics[self.metric])
        if step < 1 or value != value or (self.value is not None and value <= self.value):
            return False
        self.step, self.value = step, value
        return True

    def state(self) -> dict:
        return {"metric": self.metric, "step": self.step, "value": self.value}

    def restore(self, folder: Path) -> None:
        """The best as of the checkpoint `folder` (nothing when it was saved without a best metric,
        or for another one)."""
        saved = read_trainer_state(folder).get("best") or {}
        if saved.get("metric") == self.metric and saved.get("step") is not None:
            self.step, self.value = int(saved["step"]), float(saved["value"])
            self.write_pointer()

    def write_pointer(self) -> None:
        if self.step is None:
            return
        tmp = self.root / (BEST_POINTER + ".tmp")
        tmp.write_text(json.dumps({**self.state(), "folder": f"global_step_{self.step}"}))
        _sync(tmp)
        os.replace(tmp, self.root / BEST_POINTER)
        _sync(self.root)


def best_checkpoint_folder(root: Path) -> Path | None:
    """The folder `best_checkpoint.json` names, or None when the run recorded no best."""
    pointer = root / BEST_POINTER
    if not pointer.is_file():
        return None
    step = json.loads(pointer.read_text()).get("step")
    folder = root / f"global_step_{int(step)}" if step is not None else None
    if folder is None or not folder.is_dir():
        raise CheckpointError(f"{pointer} names step {step}, whose checkpoint folder is missing")
    return folder


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _free_mb(root: Path) -> float:
    return shutil.disk_usage(root).free / 2**20


def _keeps(root: Path) -> str:
    steps = list_checkpoints(root)
    return f"; the step-{steps[-1]} checkpoint is intact and stays the latest" if steps else ""


def _check_space(root: Path, step: int) -> None:
    """Before writing: a checkpoint as large as the last one (+10%) must fit, so a full disk is
    named before the write instead of failing in the middle of it."""
    steps = [s for s in list_checkpoints(root) if s != step]
    if not steps:
        return  # nothing to size it by: the write itself is guarded
    need = _folder_bytes(root / f"global_step_{steps[-1]}") * 1.1 / 2**20
    free = _free_mb(root)
    if free < need:
        raise CheckpointError(f"{root} has {free:.0f} MB free but a checkpoint takes about {need:.0f} MB (the step-"
                              f"{steps[-1]} one){_keeps(root)}: free space, lower trainer.max_ckpt_to_keep or point "
                              "trainer.default_local_dir elsewhere, then resume")


def _out_of_space(err: BaseException, root: Path) -> bool:
    """The failed write ran out of space: ENOSPC in the chain, torch's zip writer's message (it
    hides the errno), or a worker's report of either."""
    import errno

    seen = err
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    return "No space left on device" in text or "file write failed" in text or _free_mb(root) < 1


def _sync(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list: renames and new files in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    for sub, _, files in os.walk(folder):
        for name in files:
            _sync(Path(sub) / name)
        _sync(Path(sub))


def _delete(folder: Path) -> None:
    """Rename out of the step namespace first, so that a kill mid-deletion leaves no partial step."""
    doomed = folder.with_name(folder.name + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    _sync(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def list_checkpoints(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def find_resume_folder(root: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: none (`disable`), the pointer's (`auto`), or a given path;
    its trainer state read (and checked against its folder's name) before any worker starts."""
    folder = _resume_folder(root, resume_mode)
    if folder is not None:
        read_trainer_state(folder)
    return folder


def _resume_folder(root: Path, resume_mode: str) -> Path | None:
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
    if not step.isdigit():  # the pointer names a step of this run, never a path
        raise ConfigError("trainer.resume_mode", "auto", f"{pointer} holds {step[:40]!r}, not a step number: "
                          f"write the step of a checkpoint in {root} into it, or use resume_mode=disable")
    folder = root / f"global_step_{step}"
    staged = root / f"global_step_{step}.tmp"
    if not folder.is_dir() and (staged / "trainer_state.json").is_file():
        # killed while re-saving this step, between moving the old folder aside and renaming the
        # new (complete, synced) one into place: finish the rename
        os.replace(staged, folder)
        _sync(root)
    if not folder.is_dir():
        raise ConfigError("trainer.resume_mode", "auto",
                          f"{pointer} points at step {step} but {folder} is missing: fix the pointer or resume_mode=disable")
    return folder


def read_trainer_state(folder: Path) -> dict:
    """A checkpoint's trainer_state.json ({"global_step": N} and, with trainer.best_metric, "best");
    a damaged file stops with one message naming it and the checkpoints to fall back to."""
    from pixelrl.engine.checkpoint import CheckpointError, read_checkpoint_file

    def read(path: Path) -> dict:
        state = json.loads(path.read_text())
        int(state["global_step"])  # a state without a step is damaged
        return state

    state = read_checkpoint_file(folder / "trainer_state.json", read)
    named = STEP_DIR.match(folder.name)
    if named and int(named.group(1)) != int(state["global_step"]):
        # a resume would start at the file's step and quietly train fewer (or more) steps than asked
        raise CheckpointError(f"`{folder / 'trainer_state.json'}` says global step {state['global_step']}, its folder "
                              f"says {named.group(1)}: the folder was renamed or its files copied from another "
                              "step's; put back the checkpoint's own trainer_state.json, or resume from another")
    return state


def load_trainer_state(folder: Path) -> tuple[int, dict]:
    from pixelrl.engine.checkpoint import read_checkpoint_file

    step = int(read_trainer_state(folder)["global_step"])
    loader_state = read_checkpoint_file(folder / "data.pt", lambda p: torch.load(p, weights_only=True))
    return step, loader_state


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


# What a checkpoint's weights, optimizer and data position were made for: resuming with another
# value would load them into a different model or a different data order without a word (and
# rollout.scores_teacher: which workers hold the teacher its queued batches were or were not scored by).
RESUME_FIXED = ("algorithm.trainer_type", "model.type", "model.path", "model.lora_rank", "model.lora_alpha",
                "model.lora_target_modules", "data.train_batch_size", "data.seed", "data.shuffle", "rollout.n",
                "diffusion_loss.teacher", "diffusion_loss.params.cycle", "rollout.scores_teacher")
ADAPTER_ONLY = ("model.lora_alpha", "model.lora_target_modules")
# RESUME_CHANGEABLE may change on resume on purpose (a reward curriculum, a new prompt set), when
# trainer.resume_changes names them; then a warning names each. Without it, a resume that changes
# one is refused: a command that forgot an override would otherwise train on other data or reward.


def check_resume_config(folder: Path, config_yaml: str) -> list[str]:
    """Stop before any worker starts when the run's config differs from the checkpoint's on a
    field in RESUME_FIXED; return a warning for each field of RESUME_CHANGEABLE that differs.
    Anything else (learning rate, steps, logging) may change on resume."""
    from omegaconf import OmegaConf

    from pixelrl.algos.config import TRAINER_TYPE_ALIASES

    saved_file = folder / "config.yaml"
    if not saved_file.is_file():
        return []  # older checkpoints carry no config; their files are checked as they load
    saved, current = OmegaConf.create(saved_file.read_text()), OmegaConf.create(config_yaml)
    warnings = []
    def value(config, field):  # plain Python values, so lists and mappings compare by content
        found = OmegaConf.select(config, field)
        return OmegaConf.to_container(found) if OmegaConf.is_config(found) else found

    allowed = value(current, "trainer.resume_changes") or []
    for field in RESUME_CHANGEABLE:
        before, now = value(saved, field), value(current, field)
        if before == now:
            continue
        if field not in allowed:
            raise ConfigError(field, now, f"the checkpoint {folder.name} was trained with {before!r}: resume with that "
                              f"value (repeat the overrides the run started with), or change it on purpose with "
                              f"trainer.resume_changes=[{field}]")
        effect = ("the rewards logged from here on are not comparable with the earlier ones" if field.startswith("reward")
                  else "the data loader's position was saved for the earlier data and is applied to these rows")
        warnings.append(f"warning: resuming {folder.name} with `{field}` = {now!r}; it was trained with "
                        f"{before!r} ({effect})")
    trains_adapter = value(saved, "model.lora_rank") or value(current, "model.lora_rank")
    for field in RESUME_FIXED:
        if field in ADAPTER_ONLY and not trains_adapter:  # full fine-tuning both times: no adapter to differ
            continue
        before, now = value(saved, field), value(current, field)
        if field == "model.path":
            before, now = (str(Path(v).expanduser().resolve()) if v and ":" not in str(v) else v for v in (before, now))
        if field == "algorithm.trainer_type":  # a checkpoint saved under the type's former name
            before = TRAINER_TYPE_ALIASES.get(before, before)
        if before != now:
            hint = (f" (if the same model now lives elsewhere, edit model.path in {saved_file})"
                    if field == "model.path" else "")
            raise ConfigError(field, now, f"the checkpoint {folder.name} was trained with {before!r}: resume with "
                              f"that value{hint}, or start a new run (another trainer.default_local_dir, or "
                              "trainer.resume_mode=disable)")
    return warnings


def load_for_eval(model_path: str | None = None, checkpoint: str | None = None):
    """The model to evaluate: a pipeline folder (or `builtin:shapes`), or a training checkpoint
    (its base model with the trained weights of `global_step_N/actor` applied, their EMA when the
    run kept one). A folder loads with its family's defaults and the options its
    pixelrl_model.json declares."""
    from pixelrl.models.loader import load_configured_model, load_folder_model

    if checkpoint is None:
        return load_folder_model(str(model_path or "builtin:shapes"))
    from pixelrl.config.sections import from_yaml_text
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.policy_engine import PolicyEngine

    folder = Path(checkpoint)
    for needed in ("config.yaml", "actor"):
        if not (folder / needed).exists():
            where = "the folder does not exist" if not folder.is_dir() else f"it holds no {needed}"
            raise ConfigError("--checkpoint", str(checkpoint), f"{where}: give a global_step_N folder of a training "
                              "run (RUN/checkpoints/global_step_N, holding config.yaml and actor/)")
    cfg = from_yaml_text((folder / "config.yaml").read_text())
    cfg.diffusion_loss.teacher = "base"  # the student alone: evaluation replays no distillation teacher
    _check_same_base(cfg.model.path, model_path)
    model = load_configured_model(cfg.model, model_path)
    engine = PolicyEngine(model, cfg)
    load_engine(engine, folder / "actor")
    if engine.weights_ema is not None:  # the weights the run's validation scored (actor.ema_decay)
        engine.weights_ema.copy_to_params()
    return engine.model


def _check_same_base(trained_on: str, model_path: str | None) -> None:
    """`--model` with a checkpoint names where its base model lives now; naming another model
    while the one it trained on is still there would apply its weights to the wrong base (images
    of neither, no error: LoRA shapes match across same-architecture models)."""
    from pixelrl.core.assets import resolve

    if model_path is None:
        return
    trained, given = (Path(resolve(str(p))).expanduser().resolve() for p in (trained_on, model_path))
    if trained.is_dir() and trained != given:
        raise ConfigError("--model", str(model_path), f"the checkpoint was trained on {trained_on}, which is still "
                          "there: leave --model out to use it (--model is for a base model that has moved)")
