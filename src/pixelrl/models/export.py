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
# `resolution`: the side it was trained at (a model folder's pipeline default may be another: FLUX.1
# Kontext's is 1024 px, whatever the transformer learnt)
SAMPLER_FILE = "pixelrl_sampler.json"
SAMPLER_FIELDS = {"num_steps": int, "guidance_scale": float, "sigma_schedule": str, "sigma_shift": float,
                  "negative_prompt": str, "resolution": int, "diffusers": dict}


def write_sampler(folder: str | Path, sampler: dict) -> Path:
    unknown = sorted(set(sampler) - set(SAMPLER_FIELDS))
    if unknown:
        raise ValueError(f"a sampler file holds {sorted(SAMPLER_FIELDS)}, not {unknown}")
    path = Path(folder) / SAMPLER_FILE
    path.write_text(json.dumps(sampler, indent=1) + "\n")
    return path


def diffusers_example(family, folder: str | Path, sampler: dict, resolution: int, max_sequence_length: int,
                      base: str | Path | None = None) -> str:
    """Plain diffusers that samples the exported model as the run validated it: the pipeline folder
    (or the base with the adapter loaded, `base` given), the grid when it is one of the run's own, the
    steps, guidance, size and text tokens. A folder without an autoencoder (the shapes models) has
    no diffusers sampling: one line says so."""
    index = json.loads((Path(base or folder) / "model_index.json").read_text())
    if index.get("vae", [None])[0] is None:
        return (f"# {Path(folder)} has no autoencoder (it generates pixels directly): diffusers' "
                f"{family.pipeline_class_name} cannot sample it as it is; use `pixelrl generate --model {folder}`")
    cls = family.pipeline_class_name
    custom = "diffusers" in sampler
    lines = ["import torch", f"from diffusers import {cls}" + (", FlowMatchEulerDiscreteScheduler" if custom else "")]
    # a component the folder leaves out (SD3 without T5) is passed as None, or diffusers refuses to load
    absent = "".join(f", {name}=None" for name, entry in index.items()
                     if not name.startswith("_") and isinstance(entry, list) and entry[0] is None)
    if base is None:
        lines.append(f"pipe = {cls}.from_pretrained({str(folder)!r}{absent})")
    else:
        lines.append(f"pipe = {cls}.from_pretrained({str(base)!r}{absent})")
        # a denoiser of experts: one adapter folder per trained expert, each loaded into its own
        experts = [e for e in family.expert_names(Path(base)) if (Path(folder) / e).is_dir()]
        lines += [f"pipe.load_lora_weights({str(Path(folder) / e)!r}" + (f", load_into_{e}=True)" if i else ")")
                  for i, e in enumerate(family.expert_names(Path(base))) if e in experts] \
            or [f"pipe.load_lora_weights({str(folder)!r})"]
    if custom:
        options = ", ".join(f"{k}={v!r}" for k, v in sampler["diffusers"]["scheduler"].items())
        lines.append(f"pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, {options})")
    edits = family.condition_images > 0
    call = [f"prompt={'make the red circle blue' if edits else 'a red circle'!r}",
            f"num_inference_steps={sampler['num_steps']}",
            f"{family.diffusers_guidance_argument}={sampler['guidance_scale']:g}"]
    if edits:  # the picture to edit, as the pipeline takes it (positional, it would be the prompt)
        lines[1:1] = ["from diffusers.utils import load_image"]
        lines.append('source = load_image("your_source.png")  # the picture to edit')
        call.insert(1, "image=source" if family.most_condition_images in (None, 1) else "image=[source]")
    call += [f"height={resolution}", f"width={resolution}"]
    if family.diffusers_edit_size:  # what else the pipeline needs to keep the trained size
        call.append(family.diffusers_edit_size.format(area=resolution * resolution))
    if edits:
        lines.append(f"# a source that is not square: pixelrl generate prints the output size it takes (about {resolution}"
                     f" x {resolution} px in the source's aspect); give it as height and width"
                     + (" (max_area their product)" if "max_area" in family.diffusers_edit_size else "")
                     + ", and the source cropped to that aspect as pixelrl crops it")
    if custom:
        call.append(f"sigmas={sampler['diffusers']['call']['sigmas']}")
    # always given: the pipelines' default (SD3: 256 T5 tokens) is not what the run trained with,
    # and an SD3 run with no T5 tokens samples another picture with 256 of them
    call.append(f"max_sequence_length={max_sequence_length}")
    if sampler.get("negative_prompt") and family.uses_negative_prompt and sampler["guidance_scale"] > 1:
        call.append(f"negative_prompt={sampler['negative_prompt']!r}")
    call.append("generator=torch.Generator().manual_seed(0)")
    lines.append(f"sample = pipe({', '.join(call)}).{family.diffusers_output}[0]")
    return "\n".join(lines)


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
    if sampler.get("resolution", 1) < 1:
        raise ModelFolderError(f"{path}: resolution {sampler['resolution']} is not an image side; give the side the "
                               "model was trained at in pixels, or drop the field")
    return sampler


def _check_weights_read(folder: Path) -> None:
    """Every safetensors file of `folder` reads whole: its header parses and every tensor loads."""
    files = sorted(folder.rglob("*.safetensors"))  # a two-expert adapter: one folder per expert
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
    if adapter.is_dir():  # a torn adapter is named before the base pipeline loads (minutes for a real model)
        _check_weights_read(adapter)  # a copy of a torn file would look like a good export
    if adapter_only:
        if not adapter.is_dir():
            raise ModelFolderError(f"`{actor_dir}` holds no LoRA adapter (a full fine-tune): export without --adapter-only")
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        return out
    family = model_family(model_type)
    pipe = family.load_pipeline(base_model)
    if adapter.is_dir():
        family.fuse_lora_into_pipeline(pipe, adapter)
    else:
        if not state_file.is_file():
            raise ModelFolderError(f"`{actor_dir}` holds no {state_file.name}"
                                   + (": the run kept no EMA (actor.ema_decay 0)" if weights == "ema" else ""))
        state = load_file(str(state_file))
        unexpected = family.denoiser_state_into_pipeline(pipe, state)
        if unexpected:
            raise ModelFolderError(f"`{actor_dir}` weights do not match the base transformer: {unexpected[:3]}")
    family.save_pipeline(pipe, out)
    if trained_options:
        write_declared_options(out, trained_options)
    return out
