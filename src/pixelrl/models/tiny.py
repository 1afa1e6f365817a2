"""Offline pieces the families' tiny builders share: tokenizers and small text encoders.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on the spot with
`tokenizers`, and every model is built from a small config. Tests and benchmarks use the tiny
folders exactly as they would use a real checkpoint folder. Each family's own builder lives in
its folder (`models/sd3/tiny.py`, ...).
"""

from __future__ import annotations

from typing import Iterable

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# Enough English to tokenise typical test prompts into whole words.
DEFAULT_WORDS = (
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


def build_clip_tokenizer(words: Iterable[str] = DEFAULT_WORDS, *, max_length: int = 32):
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
                      seed: int = 0, with_projection: bool = True):
    """A small random CLIP text encoder: with its projection (SD3's pooled vectors) or without
    (FLUX takes the pooled output itself)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

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
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def build_t5_tokenizer(words: Iterable[str] = DEFAULT_WORDS, *, max_length: int = 32):
    """A T5-style Unigram tokenizer whose pieces are the given words plus single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in dict.fromkeys(words)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789\u2581"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


