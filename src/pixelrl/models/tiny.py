"""Offline builders for tiny SD3-family pipelines (random weights) and their tokenizers.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on the spot with
`tokenizers`, and every model is built from a small config. Tests and benchmarks use these
folders exactly as they would use a real SD3.5 folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# Enough English to tokenise typical test prompts into whole words.
_DEFAULT_WORDS = (
    "a an the of on in to and with photo picture image painting drawing small big large tiny red green "
    "blue yellow orange purple pink white black brown gray cyan magenta circle circles square squares "
    "triangle triangles star stars cat dog car tree house flower sky sea mountain city street left right "
    "above below next one two three four five six seven eight nine ten sign that says text word"
).split()


def _train_bpe(words: list[str]) -> list[tuple[str, str]]:
    """Deterministic BPE merges that make every word in `words` a single token.

    Classic BPE training (most frequent adjacent pair first; ties broken by the pair's text),
    so BPE inference replays exactly these merges on a training word. Written out because the
    `tokenizers` trainer breaks ties in a run-dependent order, which would make token ids (and
    so every tiny model built from them) differ between runs.
    """
    from collections import Counter

    segments = {w: tuple(w[:-1]) + (w[-1] + "</w>",) for w in dict.fromkeys(words) if w}
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter(p for seg in segments.values() for p in zip(seg, seg[1:]))
        if not pairs:
            return merges
        best = max(pairs.items(), key=lambda kv: (kv[1], tuple(-ord(c) for c in kv[0][0] + " " + kv[0][1])))[0]
        merges.append(best)
        for word, seg in segments.items():
            merged, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and (seg[i], seg[i + 1]) == best:
                    merged.append(seg[i] + seg[i + 1])
                    i += 2
                else:
                    merged.append(seg[i])
                    i += 1
            segments[word] = tuple(merged)


def build_clip_tokenizer(words: Iterable[str] = _DEFAULT_WORDS, *, max_length: int = 32):
    """A CLIP-style tokenizer (byte-level BPE with `</w>` word ends) in which every word of
    `words` (lowercase ASCII) is one token; other text falls back to characters."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    words = sorted({w.lower() for w in words})
    vocab: dict[str, int] = {BOS: 0, EOS: 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = _train_bpe(words)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def tiny_clip_encoder(tokenizer, *, hidden: int = 32, layers: int = 2, heads: int = 2, projection: int = 32,
                      seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def build_t5_tokenizer(words: Iterable[str] = _DEFAULT_WORDS, *, max_length: int = 32):
    """A T5-style Unigram tokenizer whose pieces are the given words plus single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in dict.fromkeys(words)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789\u2581"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


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
    words = list(words) if words is not None else list(_DEFAULT_WORDS)
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


def build_tiny_clip(path: str | Path, *, image_size: int = 32, hidden: int = 32, projection: int = 16,
                    words: Iterable[str] = _DEFAULT_WORDS, seed: int = 0) -> Path:
    """Write a tiny random transformers CLIPModel with its processor (the layout of a local copy of
    openai/clip-vit-large-patch14 or PickScore_v1) to `path`; `CLIPModel.from_pretrained(path)` and
    `CLIPProcessor.from_pretrained(path)` load it."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tokenizer = build_clip_tokenizer(words, max_length=32)
    torch.manual_seed(seed)
    small = dict(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(small, vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(small, image_size=image_size, patch_size=image_size // 4),
        projection_dim=projection,
    )
    path = Path(path)
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path
