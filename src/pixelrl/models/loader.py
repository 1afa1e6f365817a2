"""Build a `DiffusionModel` from a model type name and a local folder."""

from __future__ import annotations

from pixelrl.core.errors import ConfigError
from pixelrl.core.registry import Registry
from pixelrl.models.base import DiffusionModel

MODEL_TYPES: Registry = Registry("model type", "model.type")


@MODEL_TYPES.register("sd3")
def _load_sd3(path, **kwargs) -> DiffusionModel:
    from pixelrl.models.sd3 import SD3Model

    return SD3Model(path, **kwargs)


def load_model(model_type: str, path, **kwargs) -> DiffusionModel:
    """`path` is a local pipeline folder or `builtin:shapes` (the shipped shapes model)."""
    from pixelrl.core.assets import resolve

    if not path:
        raise ConfigError("model.path", path, "set it to a local diffusers pipeline folder")
    return MODEL_TYPES.get(model_type)(resolve(str(path)), **kwargs)


def latent_unit(model_type: str, path) -> int | None:
    """The pixel multiple an image side must be for this model folder (VAE scale x patch size),
    read from its config files without loading weights; None when the folder is not there yet
    (loading it reports that)."""
    import json
    from pathlib import Path

    from pixelrl.core.assets import resolve

    folder = Path(resolve(str(path)))
    transformer = folder / "transformer" / "config.json"
    if model_type != "sd3" or not transformer.is_file():
        return None
    patch = int(json.loads(transformer.read_text()).get("patch_size", 1))
    vae = folder / "vae" / "config.json"
    scale = 2 ** (len(json.loads(vae.read_text()).get("block_out_channels", [0])) - 1) if vae.is_file() else 1
    return patch * scale
