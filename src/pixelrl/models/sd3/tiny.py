"""Offline builder for a tiny random SD3 pipeline folder (the layout of a real SD3.5 folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pixelrl.models.tiny import DEFAULT_WORDS, build_clip_tokenizer, build_t5_tokenizer, tiny_clip_encoder


def build_tiny_sd3(
    path: str | Path,
    *,
    resolution: int = 32,
    with_vae: bool = True,
    with_t5: bool = True,
    words: Iterable[str] | None = None,
    text_hidden: int = 32,
    text_layers: int = 2,
    text_max_length: int = 32,
    num_layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    patch_size: int = 2,
    shift: float = 3.0,
    seed: int = 0,
) -> Path:
    """Write a tiny random SD3 pipeline folder (diffusers layout) to `path`; returns the path.

    With the defaults (VAE and T5, the full SD3.5 layout) diffusers loads it with
    `StableDiffusion3Pipeline.from_pretrained(path)`. diffusers requires every SD3 component, so a
    folder built without T5 needs `text_encoder_3=None, tokenizer_3=None` there, and a pixel-space
    one (`with_vae=False`) `vae=None` and `output_type="latent"`; pixelrl loads all of them as is.

    `words` is the tokenizer's training vocabulary (whole words become single tokens);
    each of the two CLIP encoders has width `text_hidden` and `text_layers` layers.
    `with_t5` adds a tiny T5 encoder (text_encoder_3) as in the full SD3.5 layout.
    With `with_vae` the VAE halves the resolution into 4 latent channels (SD3 uses 16 and a
    factor of 8; the code path is the same). Without it the model works in RGB pixel space.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    path = Path(path)
    clip_dim = text_hidden
    words = list(words) if words is not None else list(DEFAULT_WORDS)
    tok1 = build_clip_tokenizer(words, max_length=text_max_length)
    tok2 = build_clip_tokenizer(words, max_length=text_max_length)
    enc1 = tiny_clip_encoder(tok1, hidden=clip_dim, layers=text_layers, projection=clip_dim, seed=seed + 1)
    enc2 = tiny_clip_encoder(tok2, hidden=clip_dim, layers=text_layers, projection=clip_dim, seed=seed + 2)

    t5, t5_tok = None, None
    if with_t5:
        from transformers import T5Config, T5EncoderModel

        torch.manual_seed(seed + 4)
        t5_tok = build_t5_tokenizer()
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=2 * clip_dim, d_kv=8, d_ff=64,
                                     num_layers=1, num_heads=4, pad_token_id=t5_tok.pad_token_id,
                                     eos_token_id=t5_tok.eos_token_id))

    vae = None
    latent_channels, latent_size = 3, resolution
    if with_vae:
        torch.manual_seed(seed + 3)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
            sample_size=resolution, scaling_factor=1.5305, shift_factor=0.0609,
        )
        latent_channels, latent_size = 4, resolution // 2

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=patch_size,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=2 * clip_dim,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * clip_dim,
        pos_embed_max_size=max(latent_size // patch_size, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=enc1, tokenizer=tok1, text_encoder_2=enc2, tokenizer_2=tok2,
        text_encoder_3=t5, tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    return path
