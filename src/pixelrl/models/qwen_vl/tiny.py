"""Offline builder for tiny Qwen2-VL and Qwen2.5-VL folders (random weights, a word-level tokenizer).

The folder has the layout of a real Qwen2-VL checkpoint (config.json, model.safetensors,
tokenizer.json with a chat template, preprocessor_config.json), so the adapter loads both the
same way. Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

# Qwen2-VL's special tokens: the image placeholder is expanded to one token per merged patch.
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
UNK = "<unk>"

# A Qwen-style chat template reduced to what the tiny tokenizer can spell: roles and contents
# separated by spaces, an image as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

# The shipped shapes-QA architecture (see the model card).
SHAPES_QA_ARCH = dict(image_size=32, patch_size=4, vision_depth=2, vision_dim=64, hidden=128, layers=3, heads=4,
                      kv_heads=2)


def build_word_tokenizer(words: Iterable[str]):
    """A word-level tokenizer (whitespace split, punctuation separate) with Qwen2-VL's special
    tokens; every word of `words` is one token, anything else is <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, UNK, "user", "assistant", *sorted(set(words))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    # Registered on the backend, so each is matched whole before the whitespace split: passed only
    # as `additional_special_tokens`, transformers 5 drops the ones that `extra_special_tokens`
    # does not name, and "<|im_start|>" became three <unk>s.
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=IM_END, pad_token=PAD, unk_token=UNK, padding_side="left",
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_bos_token": VISION_START, "vision_eos_token": VISION_END})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_qwen_vl(path: str | Path, *, words: Iterable[str], image_size: int = 32, patch_size: int = 4,
                       vision_depth: int = 1, vision_dim: int = 32, hidden: int = 64, layers: int = 1,
                       heads: int = 4, kv_heads: int = 2, seed: int = 0, version: str = "2") -> Path:
    """Write a tiny random Qwen2-VL (`version="2"`) or Qwen2.5-VL (`"2.5"`) folder to `path` for
    images of `image_size` pixels; returns it.

    The image processor resizes every image to exactly `image_size` x `image_size`, so an image
    becomes (image_size / patch_size / 2)^2 tokens after the 2 x 2 patch merge. The Qwen2.5-VL
    tower has what sets it apart: windowed attention (a window of 2 x 2 merged patches) in every
    block but the last, which attends over the whole image, and SwiGLU MLPs.
    """
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if version not in ("2", "2.5"):
        raise ValueError(f"version must be '2' or '2.5', got {version!r}")

    path = Path(path)
    tokenizer = build_word_tokenizer(words)
    ids = tokenizer.convert_tokens_to_ids
    head_dim = hidden // heads
    # Qwen2-VL splits the rotary frequencies into (time, height, width) sections, 1/4 : 3/8 : 3/8
    spatial = 3 * (head_dim // 2) // 8
    mrope = [head_dim // 2 - 2 * spatial, spatial, spatial]
    vision = dict(depth=vision_depth, num_heads=4, patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if version == "2":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=vision_dim, hidden_size=hidden, mlp_ratio=2)
    else:
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=vision_dim, intermediate_size=2 * vision_dim, out_hidden_size=hidden,
                      window_size=2 * 2 * patch_size, fullatt_block_indexes=[vision_depth - 1])
    config = config_class(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0},
                         max_position_embeddings=256, bos_token_id=ids(IM_START), eos_token_id=ids(IM_END),
                         pad_token_id=ids(PAD), tie_word_embeddings=True),
        vision_config=vision,
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = model_class(config)
    pixels = image_size * image_size
    processor = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=patch_size,
                                         merge_size=2, temporal_patch_size=2)
    model.generation_config.pad_token_id = ids(PAD)
    model.generation_config.eos_token_id = ids(IM_END)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path
