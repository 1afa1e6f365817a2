"""Model families by name (`model.type`), and building a `DiffusionModel` from a local folder.

A family is one folder under `models/` with its `FamilySpec` (`spec.py`) and one line here; each
entry imports its family lazily, so a run pays only for the family it uses. A plugin adds a
family with `register_family(name, lambda: SPEC)`."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.core.registry import Registry
from pixelrl.models.base import DiffusionModel
from pixelrl.models.family import FamilySpec

# name -> a function returning the family's FamilySpec (imported on first use)
MODEL_TYPES: Registry = Registry("model type", "model.type")


def register_family(name: str, load_spec: Callable[[], FamilySpec]) -> None:
    MODEL_TYPES.register(name)(load_spec)


def _built_in(folder: str) -> Callable[[], FamilySpec]:
    return lambda: importlib.import_module(f"pixelrl.models.{folder}.spec").SPEC


for _name in ("sd3", "flux", "flux_kontext", "qwen_image", "qwen_image_edit", "wan"):
    register_family(_name, _built_in(_name))


def family_spec(model_type: str, field: str = "model.type") -> FamilySpec:
    """The spec of `model_type` (a ConfigError naming `field` for an unknown name)."""
    spec = MODEL_TYPES.get(model_type, field)()
    if not isinstance(spec, FamilySpec) or spec.name != model_type:
        raise TypeError(f"the family registered as {model_type!r} returned {spec!r}, not its FamilySpec")
    return spec


def model_family(model_type: str) -> type[DiffusionModel]:
    """The adapter class of `model.type` (a ConfigError naming the field for an unknown name)."""
    return family_spec(model_type).model_class


def load_model(model_type: str, path, **kwargs) -> DiffusionModel:
    """`path` is a local pipeline folder or `builtin:shapes` (the shipped shapes model)."""
    from pixelrl.core.assets import resolve

    if not path:
        raise ConfigError("model.path", path, "set it to a local diffusers pipeline folder")
    return model_family(model_type)(resolve(str(path)), **kwargs)


def load_configured_model(mcfg, path=None) -> DiffusionModel:
    """The model a run's `model.*` section describes (`path` overrides model.path)."""
    # the options of a denoiser of experts, passed where set (config validation refused them elsewhere)
    experts = {name: getattr(mcfg, name) for name in ("guidance_scale_2", "trained_experts")
               if getattr(mcfg, name, None) is not None}
    return load_model(mcfg.type, path or mcfg.path, device=mcfg.device, dtype=mcfg.dtype,
                      max_sequence_length=mcfg.max_sequence_length, num_frames=mcfg.num_frames, **experts)


def folder_transformer(path) -> tuple[Path | None, dict | None]:
    """`model.path` resolved, and its transformer/config.json where that folder is here."""
    from pixelrl.core.assets import resolve
    from pixelrl.models.base import read_component_config

    folder = Path(resolve(str(path))) if path else None
    return folder, read_component_config(folder, "transformer") if folder and folder.is_dir() else None


def latent_unit(model_type: str, path) -> int | None:
    """The pixel multiple an image side must be for this model folder (VAE scale x patch size),
    read from its config files without loading weights; None when the folder is not there yet
    (loading it reports that)."""
    from pixelrl.core.assets import resolve

    folder = Path(resolve(str(path)))
    return model_family(model_type).latent_unit(folder) if folder.is_dir() else None


def check_image_side(family: type[DiffusionModel], path, side: int, field: str, what: str = "this model") -> None:
    """A ConfigError naming `field` unless an image side of `side` px fits the model folder: a
    multiple of its VAE scale x patch size, within its position table (SD3). Read from the config
    files before any weight loads; nothing to check while the folder is not there (loading says so)."""
    from pixelrl.core.assets import resolve

    folder = Path(resolve(str(path)))
    if not folder.is_dir():
        return
    unit, largest = family.latent_unit(folder), family.max_side(folder)
    if unit and side % unit:
        raise ConfigError(field, side, f"{what} needs a multiple of {unit} (VAE scale x patch size), e.g. "
                          f"{side // unit * unit or unit}")
    if largest and side > largest:
        raise ConfigError(field, side, f"{what} takes at most {largest} px a side (its transformer's position "
                          f"table, pos_embed_max_size, covers no more): use {largest} or less")


def folder_pipeline_class(path) -> str | None:
    """The pipeline class a folder's model_index.json names (None without a readable index)."""
    from pixelrl.core.assets import resolve

    index = Path(resolve(str(path))) / "model_index.json"
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def folder_model_type(path) -> str | None:
    """The `model.type` of a pipeline folder, from the pipeline class in its model_index.json;
    None when the folder has no readable index or holds a pipeline no family stands for."""
    class_name = folder_pipeline_class(path)
    return next((name for name in MODEL_TYPES.names() if model_family(name).pipeline_class_name == class_name), None)


def check_model_type(model_type: str, path) -> None:
    """A folder saved by another family's pipeline than `model.type` names: one ConfigError
    naming both (loading it would fail deep in diffusers, or worse, half-load)."""
    found = folder_pipeline_class(path)
    expected = model_family(model_type).pipeline_class_name
    if found is not None and found != expected:
        match = folder_model_type(path)
        fix = f"set model.type={match}" if match else f"pixelrl has no family for {found}; families: {MODEL_TYPES.names()}"
        raise ConfigError("model.type", model_type, f"model.path holds a {found} folder, not a {expected} one: {fix}")


# A pipeline folder may declare how it was trained to be loaded, in this file: the shapes models
# were trained with zero T5 tokens, and loading them with the family default (256 zero tokens in
# the joint attention) gives a different model that scores far worse, with no error.
DECLARED_OPTIONS_FILE = "pixelrl_model.json"
DECLARABLE_OPTIONS = ("max_sequence_length",)


def declared_options(path) -> dict:
    """The `model.*` options the folder's pixelrl_model.json declares ({} without that file)."""
    from pixelrl.core.assets import resolve

    file = Path(resolve(str(path))) / DECLARED_OPTIONS_FILE
    if not file.is_file():
        return {}
    try:
        options = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ModelFolderError(f"{file}: not readable JSON ({err}); fix or delete the file") from None
    if not isinstance(options, dict) or any(k not in DECLARABLE_OPTIONS for k in options) or \
            any(type(v) is not int for v in options.values()):
        raise ModelFolderError(f"{file}: {options!r} must be an object of integer options among "
                               f"{list(DECLARABLE_OPTIONS)}, e.g. {{\"max_sequence_length\": 0}}")
    return options


def write_declared_options(folder, options: dict) -> None:
    """Declare in `folder` how its model was trained to be loaded (the inverse of declared_options)."""
    unknown = sorted(set(options) - set(DECLARABLE_OPTIONS))
    if unknown:
        raise ValueError(f"only {list(DECLARABLE_OPTIONS)} can be declared, not {unknown}")
    (Path(folder) / DECLARED_OPTIONS_FILE).write_text(json.dumps({k: int(v) for k, v in options.items()}) + "\n")


def load_folder_model(path, **kwargs) -> DiffusionModel:
    """Load a pipeline folder as the family its model_index.json names (eval / generate), with
    the options the folder declares (`kwargs` override them)."""
    from pixelrl.core.assets import resolve

    model_type = folder_model_type(path)
    if model_type is None:
        raise ModelFolderError(f"model folder `{resolve(str(path))}`: its model_index.json is missing or names a "
                               f"pipeline pixelrl has no family for (families: {MODEL_TYPES.names()}); point at a "
                               "diffusers pipeline folder saved by one of their pipelines")
    return load_model(model_type, path, **{**declared_options(path), **kwargs})
