"""Qwen-Image-Edit (`QwenImageEditPlusPipeline`, the 2509 and 2511 releases): Qwen-Image's
denoiser editing an image: the source's latents appended to the target's tokens, and a text
encoder that reads the source as well as the instruction."""

from pixelrl.models.qwen_image_edit.model import QwenImageEditModel
from pixelrl.models.qwen_image_edit.tiny import build_tiny_qwen_image_edit

__all__ = ["QwenImageEditModel", "build_tiny_qwen_image_edit"]
