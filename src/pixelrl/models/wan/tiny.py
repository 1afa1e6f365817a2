"""Offline builder for a tiny random Wan 2.1 text-to-video pipeline folder."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pixelrl.models.tiny import DEFAULT_WORDS, build_t5_tokenizer


def build_tiny_wan(path: str | Path, *, words: Iterable[str] | None = None, text_dim: int = 32,
                   text_max_length: int = 32, num_layers: int = 2, heads: int = 2, head_dim: int = 16,
                   seed: int = 0, boundary_ratio: float | None = None, ti2v: bool = False) -> Path:
    """Write a tiny random Wan 2.1 folder (diffusers layout) that `WanPipeline.from_pretrained(path)`
    loads with no extra arguments; returns the path.

    Wan's own classes, small: a UMT5 encoder, AutoencoderKLWan (here 2x spatial and 2x temporal:
    4k + 1 frames... with k latent frames after the first; 4 channels) and WanTransformer3DModel
    with (1, 2, 2) patches; a flow-matching scheduler with shift 3. With `boundary_ratio`, a Wan 2.2
    A14B layout: a second, differently initialised transformer (`transformer_2`, the low-noise
    expert) taking the timesteps below `boundary_ratio x 1000`.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    tokenizer = build_t5_tokenizer(list(words) if words is not None else list(DEFAULT_WORDS),
                                   max_length=text_max_length)
    torch.manual_seed(seed + 1)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=text_dim, d_kv=8, d_ff=64, num_layers=1,
                                          num_heads=4, pad_token_id=tokenizer.pad_token_id,
                                          eos_token_id=tokenizer.eos_token_id))
    torch.manual_seed(seed + 2)
    z_dim = 4
    # the Wan 2.2 VAE's residual blocks need its last two widths equal (as its [1, 2, 4, 4])
    layout = dict(dim_mult=[1, 1], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                  scale_factor_spatial=4) if ti2v else dict(dim_mult=[1, 2], scale_factor_spatial=2)
    vae = AutoencoderKLWan(base_dim=8, z_dim=z_dim, num_res_blocks=1, attn_scales=[], temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
                           scale_factor_temporal=2, **layout)
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                        in_channels=z_dim, out_channels=z_dim, text_dim=text_dim, freq_dim=32,
                                        ffn_dim=2 * heads * head_dim, num_layers=num_layers, rope_max_seq_len=64)
    pipeline_options = dict(expand_timesteps=True) if ti2v else {}
    if boundary_ratio is not None:
        torch.manual_seed(seed + 3)
        pipeline_options.update(boundary_ratio=boundary_ratio, transformer_2=WanTransformer3DModel(**transformer.config))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, scheduler=scheduler, transformer=transformer,
                **pipeline_options).save_pretrained(path, safe_serialization=True)
    return path
