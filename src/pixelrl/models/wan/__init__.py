"""Wan 2.1 text-to-video (`WanPipeline`): 3-D transformer over 5-D video latents, UMT5 prompts,
CFG as a doubled batch; decode gives uint8 frames [B, T, H, W, 3]."""

from pixelrl.models.wan.model import WanModel
from pixelrl.models.wan.tiny import build_tiny_wan

__all__ = ["WanModel", "build_tiny_wan"]
