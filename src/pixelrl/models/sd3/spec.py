"""SD3 / SD3.5 as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import (CLIP_G, CLIP_L, SD3_VAE_PARAMS, T5_XXL, DenoiserCost, FamilySpec, Release, RowInput,
                                   tokens_per_side)
from pixelrl.models.sd3.model import SD3Model
from pixelrl.models.sd3.tiny import build_tiny_sd3

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.47B parameters)
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))
CLIP_TOKENS = 77  # both CLIP encoders' states join the sequence, padded to 77, before any T5 tokens


def cost(c: dict, row: RowInput) -> DenoiserCost:
    """Joint blocks over image + text; the dual-attention blocks (SD3.5) add an image-only
    attention. SD3 patches its latents itself, so a token holds patch_size^2 latent cells."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    image = tokens_per_side(row.height, row.unit) * tokens_per_side(row.width, row.unit)
    layers, dual = c["num_layers"], len(c.get("dual_attention_layers") or ())
    seq = image + row.text_tokens
    flops = 2 * (seq * layers * 12 * d * d + image * dual * 4 * d * d) + 4 * d * (layers * seq * seq + dual * image * image)
    per_token = c.get("in_channels", 16) * c.get("patch_size", 2) ** 2
    return DenoiserCost(layers, d, seq, float(flops), image * per_token)


SPEC = FamilySpec(
    name="sd3", model_class=SD3Model,
    release=Release("stable-diffusion-3.5-medium", SD35_MEDIUM, 2.47e9,
                    {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL}, SD3_VAE_PARAMS),
    cost=cost,
    text_tokens=lambda max_sequence_length: CLIP_TOKENS + max(0, max_sequence_length),
    # T5 (text_encoder_3) is loaded only for a positive max_sequence_length
    loads_component=lambda name, max_sequence_length: max_sequence_length > 0 or name != "text_encoder_3",
    build_tiny=build_tiny_sd3, tiny_options=("with_vae", "with_t5"))
