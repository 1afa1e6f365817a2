"""Qwen-Image-Edit as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import FamilySpec, Release
from pixelrl.models.qwen_image.spec import SPEC as QWEN_IMAGE
from pixelrl.models.qwen_image_edit.model import QwenImageEditModel
from pixelrl.models.qwen_image_edit.tiny import build_tiny_qwen_image_edit

# The text encoder's view of the source: a 384 x 384 area (the pipeline's CONDITION_IMAGE_SIZE),
# which Qwen2.5-VL's processor rounds to 392 x 392 (multiples of 28 px), i.e. 28 x 28 patches of
# 14 px merged 2 x 2: 196 image tokens, plus "Picture 1: " and the two vision delimiters.
PICTURE_TOKENS = 196 + 6

SPEC = FamilySpec(
    name="qwen_image_edit", model_class=QwenImageEditModel,
    # Qwen/Qwen-Image-Edit-2511: Qwen-Image's 20.4B transformer (with zero_cond_t), encoder and VAE
    release=Release("Qwen-Image-Edit-2511", {**QWEN_IMAGE.release.transformer, "zero_cond_t": True},
                    QWEN_IMAGE.release.denoiser_params, QWEN_IMAGE.release.encoder_params,
                    QWEN_IMAGE.release.vae_params),
    cost=QWEN_IMAGE.cost,  # joint attention over target, source and text tokens (RowInput.condition_images)
    text_tokens=lambda max_sequence_length: max_sequence_length + PICTURE_TOKENS,
    build_tiny=build_tiny_qwen_image_edit)
