"""Saving and restoring one engine: trainable weights, optimizer, scheduler, counters.

Layout of an engine folder (written by rank 0; every rank takes part in gathering):
    trainable.safetensors      exact trainable tensors, by parameter name (for resume)
    adapter/pytorch_lora_weights.safetensors   LoRA in the family's diffusers layout (`load_lora_weights`)
    old_adapter.safetensors    the `old` adapter (DiffusionNFT's old policy, AWM's EMA) when kept
    ema.safetensors            the EMA of the trainable tensors (actor.ema_decay > 0), by name
    ema_adapter/               that EMA as a LoRA in the family's diffusers layout (LoRA runs)
    optimizer.pt               full optimizer state (loaded with weights_only=True)
    engine_state.json          lr scheduler state and counters (every trained role's)
    roles/<role>/              each trained role besides the policy (DMD2's fake_score): its
                               trainable.safetensors and optimizer.pt
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pixelrl.core.errors import PixelRLError
from pixelrl.parallel.state import (copy_full_into, full_tensor, full_trainable_state, load_trainable_state,
                                    optimizer_state, set_optimizer_state)
from pixelrl.models.lora import lora_config


class CheckpointError(PixelRLError, ValueError):
    pass


def _optimizer_state(engine) -> dict:
    return optimizer_state(engine.model.transformer, engine.learner.optimizer)


def _set_optimizer_state(engine, state: dict) -> None:
    set_optimizer_state(engine.model.transformer, engine.learner.optimizer, state)


LORA_FILE = "pytorch_lora_weights.safetensors"  # a LoRA in the family's diffusers layout


@dataclass(frozen=True)
class TeacherWeights:
    """Where an on-policy distillation teacher's weights are: `kind` "lora" (a folder in the
    diffusers LoRA layout, loaded as a frozen adapter beside the student's) or "full" (a whole
    denoiser's state: a safetensors file, or a pipeline folder's `transformer/` folder of them,
    loaded into a frozen copy of the denoiser)."""
    kind: str
    path: Path


TEACHER_FILE_FIX = ("it holds a diffusion_loss.teacher's weights and is cut short or damaged: copy or export the "
                    "teacher again, or name another one")


def teacher_weights(spec: str) -> TeacherWeights | None:
    """The weights a `diffusion_loss.teacher` entry names, or None for the base model. A
    checkpoint (global_step_N) gives the weights its validation scored: its actor's EMA when it
    kept one, else its actor's weights, as a LoRA for a LoRA run and as a whole denoiser for a full
    fine-tune; a pipeline folder (model_index.json: a `pixelrl export`, a merged LoRA, another
    fine-tune of the family) gives its transformer; any other folder is taken as a LoRA folder
    (checked at start-up to hold the LoRA file)."""
    from pixelrl.algos.distillation import BASE_TEACHER
    from pixelrl.core.assets import resolve

    if spec == BASE_TEACHER:
        return None
    folder = Path(resolve(str(spec), "diffusion_loss.teacher"))
    for inner in ("actor/ema_adapter", "actor/adapter"):
        if (folder / inner / LORA_FILE).is_file():
            return TeacherWeights("lora", folder / inner)
    if (folder / "actor").is_dir() and not (folder / "actor" / "adapter").exists():  # a full fine-tune's checkpoint
        for name in ("ema.safetensors", "trainable.safetensors"):
            if (folder / "actor" / name).is_file():
                return TeacherWeights("full", folder / "actor" / name)
    if (folder / "model_index.json").is_file():
        return TeacherWeights("full", folder / "transformer")
    return TeacherWeights("lora", folder)


def teacher_files(weights: TeacherWeights) -> list[Path]:
    """The safetensors files a teacher's weights are in: a LoRA folder's one file, a whole
    denoiser's file, or a pipeline's `transformer/` folder of them."""
    if weights.kind == "lora":
        return [weights.path / LORA_FILE]
    return [weights.path] if weights.path.is_file() else sorted(weights.path.glob("*.safetensors"))


def teacher_state(weights: TeacherWeights) -> dict[str, torch.Tensor]:
    """A whole-denoiser teacher's tensors by parameter name."""
    state: dict[str, torch.Tensor] = {}
    for file in teacher_files(weights):
        state.update(read_checkpoint_file(file, lambda path: load_file(str(path)), TEACHER_FILE_FIX))
    return state


def peft_key(name: str, adapter_name: str = "default") -> str:
    """`blocks.0.attn.to_q.lora_A.default.weight` -> `blocks.0.attn.to_q.lora_A.weight` (peft layout)."""
    return name.replace(f".{adapter_name}.", ".")


def old_adapter_names(engine) -> list[str]:
    return [n for n, _ in engine.model.transformer.named_parameters() if "lora_" in n and ".old." in n]


def save_engine(engine, folder: str | Path, *, write: bool = True) -> None:
    """Gather on every rank; write the files where `write` is true (rank 0)."""
    folder = Path(folder)
    names = engine.trainable_names()
    weights = full_trainable_state(engine.model.transformer, names)
    old = full_trainable_state(engine.model.transformer, old_adapter_names(engine)) if engine.has_old_adapter else None
    ema = ({n: full_tensor(v) for n, v in zip(names, engine.weights_ema.values)}
           if engine.weights_ema is not None else None)
    optimizer = _optimizer_state(engine)
    roles = {role: (full_trainable_state(engine.model.transformer, names),
                    optimizer_state(engine.model.transformer, learner.optimizer), learner)
             for role, (names, learner) in engine.other_roles().items()}
    if not write:
        return
    folder.mkdir(parents=True, exist_ok=True)
    _write_weights(engine, weights, folder / "trainable.safetensors", folder / "adapter")
    if old is not None:
        save_file({k: v.contiguous() for k, v in old.items()}, str(folder / "old_adapter.safetensors"))
    if ema is not None:
        _write_weights(engine, ema, folder / "ema.safetensors", folder / "ema_adapter")
    torch.save(optimizer, folder / "optimizer.pt")
    for role, (weights_of_role, optimizer_of_role, _) in roles.items():
        (folder / "roles" / role).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights_of_role.items()},
                  str(folder / "roles" / role / "trainable.safetensors"))
        torch.save(optimizer_of_role, folder / "roles" / role / "optimizer.pt")
    state = {"lr_scheduler": engine.learner.lr_scheduler.state_dict(), "counters": engine.counters(),
             "use_lora": engine.use_lora, "trainable_names": names,
             "roles": {role: {"lr_scheduler": learner.lr_scheduler.state_dict()}
                       for role, (_, _, learner) in roles.items()}}
    (folder / "engine_state.json").write_text(json.dumps(state, indent=1))


def _write_weights(engine, state: dict[str, torch.Tensor], file: Path, adapter_folder: Path) -> None:
    """Trainable tensors by name (for resume) and, for a LoRA, the family's diffusers adapter layout."""
    save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    if engine.use_lora:
        engine.model.save_lora(adapter_folder, {peft_key(k): v for k, v in state.items()},
                               lora_config(engine.model.transformer))


def load_engine(engine, folder: str | Path) -> None:
    folder = Path(folder)
    needed = ["trainable.safetensors", "optimizer.pt", "engine_state.json"]
    if engine.has_old_adapter:
        needed.append("old_adapter.safetensors")
    if engine.weights_ema is not None:
        needed.append("ema.safetensors")
    for role in engine.other_roles():
        needed += [f"roles/{role}/trainable.safetensors", f"roles/{role}/optimizer.pt"]
    missing = [n for n in needed if not (folder / n).is_file()]
    if missing:
        if missing == ["ema.safetensors"]:
            raise CheckpointError(f"checkpoint `{folder}` holds no EMA of its weights (missing {missing}): the run "
                                  "that wrote it kept none; resume it with actor.ema_decay=0 as it ran")
        raise CheckpointError(f"checkpoint `{folder}` is incomplete (missing {missing}): resume from another "
                              f"global_step_N folder or set trainer.resume_mode=disable")
    state = read_checkpoint_file(folder / "engine_state.json", lambda path: json.loads(path.read_text()))
    names = engine.trainable_names()
    if state["trainable_names"] != names:
        raise CheckpointError(f"checkpoint `{folder}` holds different trainable parameters than this model "
                              f"({len(state['trainable_names'])} vs {len(names)}): check model.lora_rank / "
                              f"lora_target_modules against the run that wrote it")
    for name in ["trainable.safetensors"] + (["old_adapter.safetensors"] if engine.has_old_adapter else []):
        read_checkpoint_file(folder / name,
                             lambda path: load_trainable_state(engine.model.transformer, load_file(str(path))))
    if engine.weights_ema is not None:
        read_checkpoint_file(folder / "ema.safetensors", lambda path: _load_ema(engine, load_file(str(path))))
    read_checkpoint_file(folder / "optimizer.pt", lambda path: _set_optimizer_state(
        engine, torch.load(path, weights_only=True, map_location="cpu")))
    engine.learner.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for role, (_, learner) in engine.other_roles().items():
        own = folder / "roles" / role
        read_checkpoint_file(own / "trainable.safetensors",
                             lambda path: load_trainable_state(engine.model.transformer, load_file(str(path))))
        read_checkpoint_file(own / "optimizer.pt", lambda path: set_optimizer_state(
            engine.model.transformer, learner.optimizer, torch.load(path, weights_only=True, map_location="cpu")))
        learner.lr_scheduler.load_state_dict(state["roles"][role]["lr_scheduler"])
    engine.set_counters(state["counters"])


def _load_ema(engine, state: dict[str, torch.Tensor]) -> None:
    names = engine.trainable_names()
    if set(state) != set(names):
        raise ValueError(f"the EMA holds {len(state)} tensors, the model trains {len(names)}")
    for name, value in zip(names, engine.weights_ema.values):
        copy_full_into(value, state[name])


def read_checkpoint_file(path: Path, read, fix: str | None = None):
    """`read(path)`, with any failure (a truncated or corrupted file, tensors of another shape)
    turned into one message naming the file and `fix`, by default the checkpoints to fall back to
    (a file read as something other than a run's checkpoint, a teacher, says its own fix)."""
    try:
        return read(path)
    except PixelRLError:
        raise
    except Exception as err:  # safetensors, torch.load and json each raise their own types
        step_folder = next((p for p in [path.parent, *path.parents] if p.name.startswith("global_step_")), None)
        others = []
        if step_folder is not None:
            others = sorted((p.name for p in step_folder.parent.glob("global_step_*")
                             if p.is_dir() and p != step_folder and p.name[12:].isdigit()),
                            key=lambda n: int(n[12:]))
        # read for training (resume) or for eval / generate / export: the advice serves both
        fallback = (f"use an earlier checkpoint of the run (here: {others}): `--checkpoint <folder>` to evaluate or "
                    "generate, trainer.resume_mode=<folder> to resume training from it" if others
                    else "no other checkpoint of the run is there: to train, start over with "
                    "trainer.resume_mode=disable; to evaluate, generate or export, name another run's checkpoint")
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        if fix is not None:
            raise CheckpointError(f"file `{path}` cannot be read ({detail}): {fix}") from None
        raise CheckpointError(f"checkpoint file `{path}` cannot be read ({detail}). When resuming with a "
                              "model.lora_rank, lora_target_modules or model other than the run that wrote it (its "
                              f"config.yaml sits beside it), use those; if the file is truncated or corrupted, "
                              f"{fallback}") from None
