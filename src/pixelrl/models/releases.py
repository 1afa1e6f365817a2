"""The published shapes of the models users train: each release's denoiser config (its
`transformer/config.json`), and the parameter counts of its text encoders and VAE.

Two users: the GPU benchmark builds random-weight folders with these denoisers, and
`pixelrl plan` estimates memory and step time from them when the config's model folder is not on
this machine (a paper config names `/models/...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Release:
    name: str
    model_type: str  # the pixelrl family
    transformer: dict  # the release's transformer/config.json
    denoiser_params: float
    # text encoders, by component folder; SD3's T5 (text_encoder_3) is loaded only when
    # model.max_sequence_length > 0
    encoder_params: dict = field(default_factory=dict)
    vae_params: float = 0.0


# stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.47B parameters)
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))
# black-forest-labs/FLUX.1-dev transformer/config.json (11.9B parameters)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# Qwen/Qwen-Image transformer/config.json (20.4B parameters)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (1.42B parameters)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

CLIP_L, CLIP_G, T5_XXL, UMT5_XXL, QWEN25_VL_7B = 123.1e6, 694.7e6, 4.762e9, 5.68e9, 8.29e9
SD3_VAE_PARAMS, WAN_VAE_PARAMS = 83.7e6, 126.9e6

RELEASES = {
    "sd3": Release("stable-diffusion-3.5-medium", "sd3", SD35_MEDIUM, 2.47e9,
                   {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL}, SD3_VAE_PARAMS),
    "flux": Release("FLUX.1-dev", "flux", FLUX_DEV, 11.9e9,
                    {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL}, SD3_VAE_PARAMS),
    "qwen_image": Release("Qwen-Image", "qwen_image", QWEN_IMAGE, 20.43e9,
                          {"text_encoder": QWEN25_VL_7B}, WAN_VAE_PARAMS),
    "wan": Release("Wan2.1-T2V-1.3B", "wan", WAN_1_3B, 1.42e9, {"text_encoder": UMT5_XXL}, WAN_VAE_PARAMS),
}
