"""Random-weight pipeline folders with the real shapes of the models users train, for GPU benchmarks.

The denoiser and the VAE have their release's exact configuration (so a step costs what it
costs on the real weights); the text encoders have the real widths but one layer, so a folder
builds in about a minute and prompt encoding (cached once per prompt) stays out of the way.
`scale="tiny"` shrinks every width and depth so the same code runs on a CPU in seconds: that is
how the benchmark is checked without a GPU.

Each builder returns (folder, pixelrl model type).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.models.loader import family_spec
from pixelrl.models.tiny import DEFAULT_WORDS, build_clip_tokenizer, build_t5_tokenizer

SD35_MEDIUM, FLUX_DEV, WAN_1_3B = (family_spec(name).release.transformer for name in ("sd3", "flux", "wan"))
# SD3 / FLUX VAE: 16 latent channels, factor 8
SD3_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
               layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
               use_quant_conv=False, use_post_quant_conv=False)
TINY = dict(
    sd35=dict(SD35_MEDIUM, sample_size=8, num_layers=2, attention_head_dim=8, num_attention_heads=2,
              joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=8,
              dual_attention_layers=(0,)),
    flux=dict(FLUX_DEV, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)),
    wan=dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
             num_layers=2, rope_max_seq_len=64),
)
TINY_VAE = dict(SD3_VAE, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                block_out_channels=(8, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=32)


def _clip(hidden: int, heads: int, projection: int | None, tokenizer, tiny: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if tiny:
        hidden, heads, projection = 16, 2, (16 if projection else None)
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=1, num_attention_heads=heads, max_position_embeddings=77,
                            projection_dim=projection or hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _t5(tokenizer, d_model: int, tiny: bool, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    d_model, d_ff, heads = (32, 64, 4) if tiny else (d_model, 10240, 64)
    return model_cls(config_cls(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // heads, d_ff=d_ff,
                                num_layers=1, num_heads=heads, feed_forward_proj="gated-gelu",
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


def build_sd35_medium(path: Path, tiny: bool = False) -> tuple[Path, str]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    words = list(DEFAULT_WORDS)
    tok1, tok2 = build_clip_tokenizer(words, max_length=77), build_clip_tokenizer(words, max_length=77)
    t5_tok = build_t5_tokenizer(words, max_length=256)
    transformer = SD3Transformer2DModel(**(TINY["sd35"] if tiny else SD35_MEDIUM))
    vae = AutoencoderKL(**(TINY_VAE if tiny else SD3_VAE), scaling_factor=1.5305, shift_factor=0.0609)
    t5_width = 32 if tiny else 4096
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        text_encoder=_clip(768, 12, 768, tok1, tiny), tokenizer=tok1,
        text_encoder_2=_clip(1280, 20, 1280, tok2, tiny), tokenizer_2=tok2,
        text_encoder_3=_t5(t5_tok, t5_width, tiny), tokenizer_3=t5_tok)
    _save(pipe, path)
    return path, "sd3"


def build_flux_dev(path: Path, tiny: bool = False, pipeline_class=None) -> tuple[Path, str]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    words = list(DEFAULT_WORDS)
    clip_tok, t5_tok = build_clip_tokenizer(words, max_length=77), build_t5_tokenizer(words, max_length=512)
    transformer = FluxTransformer2DModel(**(TINY["flux"] if tiny else FLUX_DEV))
    vae = AutoencoderKL(**(TINY_VAE if tiny else SD3_VAE), scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = (pipeline_class or FluxPipeline)(scheduler=scheduler, vae=vae, text_encoder=_clip(768, 12, None, clip_tok, tiny),
                        tokenizer=clip_tok, text_encoder_2=_t5(t5_tok, 32 if tiny else 4096, tiny), tokenizer_2=t5_tok,
                        transformer=transformer)
    _save(pipe, path)
    return path, "flux"


def build_wan_1_3b(path: Path, tiny: bool = False) -> tuple[Path, str]:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = build_t5_tokenizer(list(DEFAULT_WORDS), max_length=512)
    transformer = WanTransformer3DModel(**(TINY["wan"] if tiny else WAN_1_3B))
    # AutoencoderKLWan's defaults are Wan 2.1's VAE (base 96, z 16, 4x temporal and 8x spatial)
    vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True]) if tiny \
        else AutoencoderKLWan()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=_t5(tokenizer, 32 if tiny else 4096, tiny, umt5=True),
                       vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
                       transformer=transformer)
    _save(pipe, path)
    return path, "wan"


def build_flux_kontext_dev(path: Path, tiny: bool = False) -> tuple[Path, str]:
    """FLUX.1-Kontext-dev: FLUX.1-dev's components (the same transformer shape) in the Kontext pipeline."""
    from diffusers import FluxKontextPipeline

    return build_flux_dev(path, tiny, FluxKontextPipeline)[0], "flux_kontext"


BUILDERS = {"sd35": build_sd35_medium, "flux": build_flux_dev, "flux_kontext": build_flux_kontext_dev,
            "wan": build_wan_1_3b}


def _save(pipe, path: Path) -> None:
    """bf16 on disk halves the write and the later load; pixelrl casts to the run's dtype anyway."""
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None and name != "vae":
            module.to(torch.bfloat16)
    pipe.save_pretrained(path, safe_serialization=True)
