"""Qwen-Image (`QwenImagePipeline`): dual-stream transformer over packed latents, Qwen2.5-VL text
states with attention masks, true CFG with norm rescaling, resolution-dependent sigma shift."""

from pixelrl.models.qwen_image.model import QwenImageModel
from pixelrl.models.qwen_image.tiny import build_tiny_qwen_image

__all__ = ["QwenImageModel", "build_tiny_qwen_image"]
