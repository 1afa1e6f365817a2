"""Offline builder for a tiny random Qwen-Image pipeline folder (the layout of Qwen/Qwen-Image)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pixelrl.models.tiny import DEFAULT_WORDS

# Qwen-Image's prompt template (system prompt + user turn); its tokens before the prompt are dropped
# from the conditioning, so the tiny tokenizer must spell them in the same 34 tokens Qwen2's does.
TEMPLATE_WORDS = ("system Describe the image by detailing color shape size texture quantity text spatial "
                  "relationships of objects and background user assistant").split()


def build_qwen_image_tokenizer(words: Iterable[str], *, template_words: Iterable[str] = TEMPLATE_WORDS,
                               pieces: Iterable[str] = (",", ":"), split: str = r"\n|\w+|[^\w\s]",
                               specials: Iterable[str] = ()):
    """A word-level tokenizer with Qwen2's chat tokens in which newlines, words and punctuation are
    single tokens (as in Qwen2's BPE for the template), so the pipeline's fixed drop of the
    template's first tokens (34 for Qwen-Image) lands exactly on the prompt. `split` is the
    pre-tokenizer's pattern, `pieces` the non-word tokens it yields, `specials` further special
    tokens (Qwen-Image-Edit's vision tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chat = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials = [*chat, *specials]
    vocab = {t: i for i, t in enumerate([*specials, "<unk>", "\n", *sorted({*template_words, *words, *pieces})])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="removed", invert=True)
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=specials[1:])


def build_tiny_qwen_image(path: str | Path, *, resolution: int = 32, words: Iterable[str] | None = None,
                          text_hidden: int = 32, num_layers: int = 2, heads: int = 2, head_dim: int = 16,
                          seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image folder (diffusers layout) that
    `QwenImagePipeline.from_pretrained(path)` loads with no extra arguments; returns the path.

    Qwen-Image's own classes, small: a Qwen2.5-VL text encoder, the video-style
    AutoencoderKLQwenImage (here 2x spatial, 4 latent channels with per-channel mean and std) and
    QwenImageTransformer2DModel; the scheduler shifts by resolution as Qwen-Image's does.
    """
    from diffusers import QwenImagePipeline

    path = Path(path)
    tokenizer = build_qwen_image_tokenizer(list(words) if words is not None else list(DEFAULT_WORDS))
    QwenImagePipeline(**tiny_qwen_image_components(tokenizer, text_hidden=text_hidden, num_layers=num_layers,
                                                   heads=heads, head_dim=head_dim, seed=seed)
                      ).save_pretrained(path, safe_serialization=True)
    return path


def tiny_qwen_image_components(tokenizer, *, text_hidden: int, num_layers: int, heads: int, head_dim: int,
                               seed: int, encoder_options: dict | None = None, transformer_options: dict | None = None):
    """The random components of a tiny Qwen-Image pipeline over `tokenizer` (scheduler, vae,
    text_encoder, tokenizer, transformer), the edit family's options added to the encoder's and
    the transformer's configs."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head = text_hidden // 4
    spatial = 3 * (head // 2) // 8
    torch.manual_seed(seed + 1)
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [head // 2 - 2 * spatial, spatial,
                                                                                   spatial], "rope_theta": 10000.0},
                         max_position_embeddings=256, pad_token_id=ids("<|endoftext|>"),
                         bos_token_id=ids("<|im_start|>"), eos_token_id=ids("<|im_end|>")),
        vision_config=dict(depth=1, hidden_size=16, out_hidden_size=text_hidden, num_heads=2, intermediate_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        **(encoder_options or {})))

    torch.manual_seed(seed + 2)
    z_dim = 4
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False],
                                 latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8])
    torch.manual_seed(seed)
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * z_dim, out_channels=z_dim,
                                              num_layers=num_layers, attention_head_dim=head_dim,
                                              num_attention_heads=heads, joint_attention_dim=text_hidden,
                                              axes_dims_rope=rope, **(transformer_options or {}))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                                                max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return dict(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tokenizer, transformer=transformer)
