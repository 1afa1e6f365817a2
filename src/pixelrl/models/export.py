"""Export a trained checkpoint as something diffusers loads on its own: a standalone pipeline
folder (LoRA fused into the base weights) or an adapter folder for `load_lora_weights`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from pixelrl.core.errors import ModelFolderError


# How an exported model is meant to be sampled, written beside it: `pixelrl generate` reads it, and
# its `diffusers` entry is what a diffusers pipeline call needs (a DMD2 student's 4-step grid).
SAMPLER_FILE = "pixelrl_sampler.json"
SAMPLER_FIELDS = {"num_steps": int, "guidance_scale": float, "sigma_schedule": str, "sigma_shift": float,
                  "negative_prompt": str, "diffusers": dict}


def write_sampler(folder: str | Path, sampler: dict) -> Path:
    unknown = sorted(set(sampler) - set(SAMPLER_FIELDS))
    if unknown:
        raise ValueError(f"a sampler file holds {sorted(SAMPLER_FIELDS)}, not {unknown}")
    path = Path(folder) / SAMPLER_FILE
    path.write_text(json.dumps(sampler, indent=1) + "\n")
    return path


def read_sampler(folder: str | Path) -> dict | None:
    """The folder's sampler file, checked (None without one); JSON only, nothing in it runs."""
    path = Path(folder) / SAMPLER_FILE
    if not path.is_file():
        return None
    try:
        sampler = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelFolderError(f"{path}: not readable JSON ({err}); fix or delete the file") from None
    bad = [k for k, v in sampler.items() if k not in SAMPLER_FIELDS or not isinstance(v, SAMPLER_FIELDS[k])
           and not (SAMPLER_FIELDS[k] is float and type(v) is int)] if isinstance(sampler, dict) else ["<file>"]
    if bad:
        raise ModelFolderError(f"{path}: {bad} are not fields of a sampler file ({ {k: t.__name__ for k, t in SAMPLER_FIELDS.items()} }); "
                               "fix or delete the file")
    return sampler


def _check_weights_read(folder: Path) -> None:
    """Every safetensors file of `folder` reads whole: its header parses and every tensor loads."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"`{folder}` holds no .safetensors weights: the checkpoint is incomplete")
    for path in files:
        try:
            load_file(path)
        except Exception as err:  # safetensors raises its own error types for a torn or foreign file
            raise ModelFolderError(f"`{path}` does not read ({type(err).__name__}: {err}): the checkpoint is "
                                   "damaged; export an earlier global_step_N") from None


def export_checkpoint(actor_dir: str | Path, base_model: str | Path, out: str | Path, *, model_type: str,
                      adapter_only: bool = False, trained_options: dict | None = None, weights: str = "actor") -> Path:
    """`model_type` is the run's `model.type`: its family knows how its pipeline loads.
    `weights`: `actor` (the trained weights) or `ema` (their EMA, kept when actor.ema_decay > 0).
    `trained_options`: the run's values of the options a folder can declare (max_sequence_length),
    written into the pipeline folder's pixelrl_model.json so that it loads as it was trained."""
    from pixelrl.core.assets import resolve
    from pixelrl.models.loader import model_family, write_declared_options

    actor_dir, base_model, out = Path(actor_dir), Path(resolve(str(base_model))), Path(out)
    if weights not in ("actor", "ema"):
        raise ValueError(f"weights must be 'actor' or 'ema', got {weights!r}")
    adapter = actor_dir / ("ema_adapter" if weights == "ema" else "adapter")
    state_file = actor_dir / ("ema.safetensors" if weights == "ema" else "trainable.safetensors")
    if adapter_only:
        if not adapter.is_dir():
            raise ModelFolderError(f"`{actor_dir}` holds no LoRA adapter (a full fine-tune): export without --adapter-only")
        _check_weights_read(adapter)  # a copy of a torn file would look like a good export
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        return out
    pipe = model_family(model_type).load_pipeline(base_model)
    if adapter.is_dir():
        pipe.load_lora_weights(adapter)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    else:
        if not state_file.is_file():
            raise ModelFolderError(f"`{actor_dir}` holds no {state_file.name}"
                                   + (": the run kept no EMA (actor.ema_decay 0)" if weights == "ema" else ""))
        state = load_file(str(state_file))
        missing, unexpected = pipe.transformer.load_state_dict(state, strict=False)
        if unexpected:
            raise ModelFolderError(f"`{actor_dir}` weights do not match the base transformer: {unexpected[:3]}")
    pipe.save_pretrained(out, safe_serialization=True)
    if trained_options:
        write_declared_options(out, trained_options)
    return out
