"""FLUX.1 as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import CLIP_L, SD3_VAE_PARAMS, T5_XXL, FamilySpec, Release, joint_attention_cost
from pixelrl.models.flux.model import FluxModel
from pixelrl.models.flux.tiny import build_tiny_flux

# black-forest-labs/FLUX.1-dev transformer/config.json (11.9B parameters)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))

SPEC = FamilySpec(
    name="flux", model_class=FluxModel,
    release=Release("FLUX.1-dev", FLUX_DEV, 11.9e9, {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL}, SD3_VAE_PARAMS),
    cost=joint_attention_cost,  # CLIP gives only the pooled vector: the sequence's text is T5's
    text_tokens=lambda max_sequence_length: max_sequence_length,
    build_tiny=build_tiny_flux)
