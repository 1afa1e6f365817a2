"""Model adapters over diffusers / transformers (one folder per family), LoRA management,
parallelism over a family's own units, and offline tiny builders."""

from pixelrl.models.base import DiffusionModel, PromptEmbeds
from pixelrl.models.loader import load_model, model_family
from pixelrl.models.sd3 import SD3Model, build_tiny_sd3
from pixelrl.models.tiny import build_clip_tokenizer

__all__ = ["DiffusionModel", "PromptEmbeds", "SD3Model", "build_tiny_sd3", "build_clip_tokenizer", "load_model",
           "model_family"]
