"""Offline builder for a tiny random FLUX.1 pipeline folder (the layout of FLUX.1-dev)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pixelrl.models.tiny import DEFAULT_WORDS, build_clip_tokenizer, build_t5_tokenizer, tiny_clip_encoder


def build_tiny_flux(path: str | Path, *, resolution: int = 32, guidance_embeds: bool = True,
                    words: Iterable[str] | None = None, text_hidden: int = 32, text_max_length: int = 32,
                    num_layers: int = 1, num_single_layers: int = 2, heads: int = 2, head_dim: int = 16,
                    seed: int = 0, pipeline_class=None) -> Path:
    """Write a tiny random FLUX.1 folder (diffusers layout) that `FluxPipeline.from_pretrained(path)`
    loads with no extra arguments; returns the path.

    The architecture classes are FLUX's own (FluxTransformer2DModel with double- and single-stream
    blocks, a 2x AutoencoderKL with FLUX's scaling and shift factors and no quant convs, a CLIP text
    model for the pooled vector and a T5 encoder for the tokens), only small. `guidance_embeds`
    builds a guidance-distilled denoiser like FLUX.1-dev; without it, like schnell. The scheduler
    shifts by resolution (`use_dynamic_shifting`) as FLUX.1's does. `pipeline_class` saves the
    same components as another FLUX pipeline (FLUX.1 Kontext's).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    path = Path(path)
    words = list(words) if words is not None else list(DEFAULT_WORDS)
    clip_tok = build_clip_tokenizer(words, max_length=77 if text_max_length > 77 else text_max_length)
    # FLUX uses CLIP's pooled output, not a projection of it
    clip = tiny_clip_encoder(clip_tok, hidden=text_hidden, seed=seed + 1, with_projection=False)

    torch.manual_seed(seed + 2)
    t5_tok = build_t5_tokenizer(words, max_length=text_max_length)
    t5_dim = 2 * text_hidden
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=t5_dim, d_kv=8, d_ff=64, num_layers=1,
                                 num_heads=4, pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id))

    torch.manual_seed(seed + 3)
    latent_channels = 4
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
        sample_size=resolution, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )

    torch.manual_seed(seed)
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)  # FLUX splits 128 as (16, 56, 56)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=t5_dim,
        pooled_projection_dim=text_hidden, guidance_embeds=guidance_embeds, axes_dims_rope=rope,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    (pipeline_class or FluxPipeline)(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
                                     text_encoder_2=t5, tokenizer_2=t5_tok,
                                     transformer=transformer).save_pretrained(path, safe_serialization=True)
    return path
