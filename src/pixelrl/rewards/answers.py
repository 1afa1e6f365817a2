"""Rule-based rewards for text answers (vision-language policies).

A text reward has the signature of every reward, with response strings where an image reward
gets images: `fn(responses: list[str], prompts, metadata) -> dict[str, Tensor[B]]`.
"""

from __future__ import annotations

import re

import torch

from pixelrl.rewards.registry import register_reward


def normalise_answer(text: str) -> str:
    """Lower case, surrounding punctuation and spaces removed, inner spaces collapsed."""
    return " ".join(text.lower().strip().strip(".!?,;:").split())


@register_reward("answer_match")
def answer_match(key: str = "answer"):
    """1 when the normalised response equals the normalised `metadata[key]`, else 0."""
    def fn(responses, prompts, metadata):
        return {"answer_match": torch.tensor([float(normalise_answer(r) == normalise_answer(str(m[key])))
                                              for r, m in zip(responses, metadata)])}
    return fn


@register_reward("answer_format")
def answer_format(pattern: str = r"^\w+$"):
    """1 when the whole stripped response matches the regular expression `pattern`, else 0."""
    compiled = re.compile(pattern)

    def fn(responses, prompts, metadata):
        return {"answer_format": torch.tensor([float(bool(compiled.fullmatch(r.strip()))) for r in responses])}
    return fn


def _check_answer_format(options: dict, field: str) -> None:
    from pixelrl.core.errors import ConfigError

    try:
        re.compile(options.get("pattern", r"^\w+$"))
    except re.error as exc:
        raise ConfigError(f"{field}.pattern", options.get("pattern"), f"not a regular expression ({exc})") from None


answer_format.check_options = _check_answer_format
