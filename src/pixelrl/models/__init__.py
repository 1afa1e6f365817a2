"""Model adapters over diffusers / transformers, LoRA management, and offline tiny builders."""

from pixelrl.models.base import DiffusionModel, PromptEmbeds
from pixelrl.models.loader import load_model
from pixelrl.models.sd3 import SD3Model
from pixelrl.models.tiny import build_clip_tokenizer, build_tiny_sd3

__all__ = ["DiffusionModel", "PromptEmbeds", "SD3Model", "build_tiny_sd3", "build_clip_tokenizer", "load_model"]
