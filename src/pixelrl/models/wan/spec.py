"""Wan 2.1 text-to-video as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import UMT5_XXL, WAN_VAE_PARAMS, DenoiserCost, FamilySpec, Release, RowInput, tokens_per_side
from pixelrl.models.wan.model import WanModel
from pixelrl.models.wan.tiny import build_tiny_wan

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (1.42B parameters)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def cost(c: dict, row: RowInput) -> DenoiserCost:
    """Self-attention over the video's tokens (4x temporal compression after the first frame),
    cross-attention to the text; each token holds a 2 x 2 patch of latent cells."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    latent_frames = (row.frames - 1) // 4 + 1
    image = latent_frames * tokens_per_side(row.height, row.unit) * tokens_per_side(row.width, row.unit)
    layers = c["num_layers"]
    per_token = layers * (6 * d * d + 2 * d * c["ffn_dim"])  # self-attention, cross q/o, FFN
    flops = 2 * (image * per_token + row.text_tokens * layers * 2 * d * d) \
        + 4 * d * layers * (image * image + image * row.text_tokens)
    return DenoiserCost(layers, d, image, float(flops), image * c.get("in_channels", 16) * 4)


def build_tiny_video(path, *, resolution: int, seed: int = 0):
    """The tiny Wan folder; `resolution` is not stored in it (WanPipeline takes height and width
    at every call, as pixelrl's rollout.resolution does)."""
    return build_tiny_wan(path, seed=seed)


SPEC = FamilySpec(
    name="wan", model_class=WanModel,
    release=Release("Wan2.1-T2V-1.3B", WAN_1_3B, 1.42e9, {"text_encoder": UMT5_XXL}, WAN_VAE_PARAMS),
    cost=cost,
    text_tokens=lambda max_sequence_length: max_sequence_length,
    build_tiny=build_tiny_video,
    splits_sequence=True)
