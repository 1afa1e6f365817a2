"""Fixtures for tests and benchmarks, not used by training itself: one synchronous step of each
diffusion trainer type (producer then consumer on the same actor), and tiny random reward-model
folders in the layouts the model-based rewards load (CLIP / PickScore / HPS, BLIP for
ImageReward)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pixelrl.core.batch import Batch
from pixelrl.models.tiny import DEFAULT_WORDS, build_clip_tokenizer
from pixelrl.trainers.forward_process import train_on_forward_process
from pixelrl.trainers.step import make_rollout, train_on_transitions


def transition_step(actor, reward_fn, prompts: list[str], metadata: list[dict], global_step: int, cfg,
                         uids=None, num_workers: int = 1) -> tuple[Batch, dict[str, float]]:
    """The synchronous step: `make_rollout` then `train_on_transitions` with the same actor."""
    rollout = make_rollout(actor, reward_fn, prompts, metadata, global_step, cfg, uids)
    return rollout.batch, train_on_transitions(actor, rollout, cfg, num_workers)


def forward_process_step(actor, reward_fn, prompts: list[str], metadata: list[dict], global_step: int, cfg,
                           uids=None, num_workers: int = 1) -> tuple[Batch, dict[str, float]]:
    """The synchronous step: `make_rollout` (current or old policy) then `train_on_forward_process`."""
    rollout = make_rollout(actor, reward_fn, prompts, metadata, global_step, cfg, uids)
    return rollout.batch, train_on_forward_process(actor, rollout, cfg, num_workers)


def build_tiny_clip(path: str | Path, *, image_size: int = 32, hidden: int = 32, projection: int = 16,
                    words: Iterable[str] = DEFAULT_WORDS, seed: int = 0) -> Path:
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


def build_tiny_blip_itm(path: str | Path, *, image_size: int = 32, hidden: int = 32, words: Iterable[str] = DEFAULT_WORDS,
                        seed: int = 0) -> Path:
    """Write a tiny random transformers BlipForImageTextRetrieval with its processor (the layout of a
    local copy of a BLIP image-text-matching folder): a WordPiece tokenizer over `words` with BLIP's
    extra [DEC] / [ENC] tokens, a 2-layer ViT and a 2-layer BERT with cross-attention."""
    import tempfile

    from transformers import BertTokenizer, BlipConfig, BlipForImageTextRetrieval, BlipImageProcessorPil, BlipProcessor

    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.txt"
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        entries = dict.fromkeys([*specials, *words, *"abcdefghijklmnopqrstuvwxyz0123456789"])
        vocab.write_text("\n".join(entries) + "\n")
        tokenizer = BertTokenizer(str(vocab), model_max_length=64)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    torch.manual_seed(seed)
    small = dict(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2, num_attention_heads=2)
    config = BlipConfig(
        text_config=dict(small, vocab_size=len(tokenizer), encoder_hidden_size=hidden, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         sep_token_id=tokenizer.sep_token_id),
        vision_config=dict(small, image_size=image_size, patch_size=image_size // 4),
        projection_dim=hidden, image_text_hidden_size=hidden,
    )
    path = Path(path)
    BlipForImageTextRetrieval(config).save_pretrained(path)
    image_processor = BlipImageProcessorPil(size={"height": image_size, "width": image_size})
    BlipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path
