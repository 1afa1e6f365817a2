"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): joint-attention transformer, two CLIP
encoders and an optional T5, CFG as a doubled batch."""

from pixelrl.models.sd3.model import SD3Model
from pixelrl.models.sd3.tiny import build_tiny_sd3

__all__ = ["SD3Model", "build_tiny_sd3"]
