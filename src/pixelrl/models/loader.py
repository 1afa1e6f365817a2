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
