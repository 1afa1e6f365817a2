"""Offline builder for a tiny random Qwen-Image-Edit folder (the layout of
Qwen/Qwen-Image-Edit-2509 and -2511, loaded by `QwenImageEditPlusPipeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from pixelrl.models.qwen_image.tiny import build_qwen_image_tokenizer, tiny_qwen_image_components
from pixelrl.models.tiny import DEFAULT_WORDS

# The edit pipeline's system prompt, which it drops after encoding (its first 64 tokens, up to the
# user turn), and the words of the "Picture k: " prefixes it writes before the instruction (k <= 3).
EDIT_TEMPLATE_WORDS = ("system Describe the key features of the input image color shape size texture objects "
                       "background then explain how the user text instruction should alter or modify the image "
                       "Generate a new image that meets the user requirements while maintaining consistency with "
                       "the original input where appropriate user assistant Picture 1 2 3").split()
# Qwen2's BPE spells "user's" as two tokens and "), " as one: so must the tiny tokenizer, for the
# template to be the pipeline's 64 tokens.
EDIT_SPLIT = r"'s|\),|\n|\w+|[^\w\s]"
EDIT_PIECES = ("'s", "),", "(", ",", ".", ":")
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
EDIT_WORDS = "make it add remove change turn replace into to keep".split()  # besides the shapes words


def build_tiny_qwen_image_edit(path: str | Path, *, resolution: int = 32, words: Iterable[str] | None = None,
                               text_hidden: int = 32, num_layers: int = 2, heads: int = 2, head_dim: int = 16,
                               zero_cond_t: bool = True, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image-Edit folder that `QwenImageEditPlusPipeline` loads; returns
    the path. Qwen-Image's tiny components (`models/qwen_image/tiny.py`) with what editing adds: a
    text encoder that sees images (vision tokens in the tokenizer and its config) and the
    processor that turns the condition image into them, the vision tower seeing
    `resolution` x `resolution` pixels whatever the pipeline's resize; `zero_cond_t` is the
    2511 layout (the condition's tokens modulated at timestep 0), False the 2509 one."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pixelrl.models.qwen_image_edit.processor import ImageTextProcessor, write_processor

    path = Path(path)
    tokenizer = build_qwen_image_tokenizer(list(words) if words is not None else [*DEFAULT_WORDS, *EDIT_WORDS],
                                           template_words=EDIT_TEMPLATE_WORDS, pieces=EDIT_PIECES, split=EDIT_SPLIT,
                                           specials=VISION_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    start, pad, end = (ids(t) for t in VISION_TOKENS)
    parts = tiny_qwen_image_components(
        tokenizer, text_hidden=text_hidden, num_layers=num_layers, heads=heads, head_dim=head_dim, seed=seed,
        encoder_options=dict(image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end),
        transformer_options=dict(zero_cond_t=zero_cond_t))
    pixels = resolution * resolution
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=4, merge_size=2,
                                      temporal_patch_size=2)
    QwenImageEditPlusPipeline(**parts, processor=None).save_pretrained(path, safe_serialization=True)
    write_processor(path, ImageTextProcessor(tokenizer, images))
    return path
