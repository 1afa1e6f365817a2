"""Qwen-Image as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import QWEN25_VL_7B, WAN_VAE_PARAMS, FamilySpec, Release, joint_attention_cost
from pixelrl.models.qwen_image.model import QwenImageModel
from pixelrl.models.qwen_image.tiny import build_tiny_qwen_image

# Qwen/Qwen-Image transformer/config.json (20.4B parameters)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))

SPEC = FamilySpec(
    name="qwen_image", model_class=QwenImageModel,
    release=Release("Qwen-Image", QWEN_IMAGE, 20.43e9, {"text_encoder": QWEN25_VL_7B}, WAN_VAE_PARAMS),
    cost=joint_attention_cost,
    text_tokens=lambda max_sequence_length: max_sequence_length,
    build_tiny=build_tiny_qwen_image)
