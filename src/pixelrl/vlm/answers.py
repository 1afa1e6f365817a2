"""Rule-based rewards for text answers (vision-language policies).

A text reward has the signature of every reward, with response strings where an image reward
gets images: `fn(responses: list[str], prompts, metadata) -> dict[str, Tensor[B]]`.
"""

from __future__ import annotations

import re

import torch

from pixelrl.rewards.registry import check_number_option, register_reward


def normalise_answer(text: str) -> str:
    """Lower case, surrounding punctuation and spaces removed, inner spaces collapsed."""
    return " ".join(text.lower().strip().strip(".!?,;:").split())


def extract_answer(text: str, extract: str = "whole") -> str | None:
    """The part of a response that is its answer: `whole` the response itself; `boxed` the content
    of the last \\boxed{...} (nested braces kept); `tag` the content of the last <answer>...</answer>.
    None when the response has no such part (a reasoning model that never states its answer)."""
    if extract == "whole":
        return text
    if extract == "tag":
        found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
        return found[-1] if found else None
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None  # an unclosed box is no answer


EXTRACTORS = ("whole", "boxed", "tag")


@register_reward("answer_match")
def answer_match(key: str = "answer", extract: str = "whole"):
    """1 when the normalised answer (`extract_answer(response, extract)`) equals the normalised
    `metadata[key]`, else 0 (also when the response has no answer to extract)."""
    def fn(responses, prompts, metadata):
        values = []
        for response, m in zip(responses, metadata):
            answer = extract_answer(response, extract)
            values.append(float(answer is not None and normalise_answer(answer) == normalise_answer(str(m[key]))))
        return {"answer_match": torch.tensor(values)}
    return fn


def _check_answer_match(options: dict, field: str) -> None:
    from pixelrl.core.errors import ConfigError

    if options.get("extract", "whole") not in EXTRACTORS:
        raise ConfigError(f"{field}.extract", options.get("extract"), f"choose one of {list(EXTRACTORS)} (boxed: "
                          "the last \\boxed{...}; tag: the last <answer>...</answer>)")


answer_match.check_options = _check_answer_match


NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def parse_count(text: str) -> int | None:
    """A non-negative whole number written as digits or as an English word up to ten, else None."""
    word = normalise_answer(text)
    if word.isdigit():
        return int(word)
    return NUMBER_WORDS.index(word) if word in NUMBER_WORDS else None


@register_reward("count_closeness")
def count_closeness(key: str = "answer", scale: float = 2.0):
    """Partial credit for a count: max(0, 1 - |answered - true| / scale) when `metadata[key]` is a
    count (`parse_count`), 0 when the response is not a number; 0 on questions whose answer is not a
    count, so it moves nothing there (every answer in a group gets the same). With scale 2 an answer
    one off earns 0.5: a denser signal than exact match while the model cannot count yet."""
    def fn(responses, prompts, metadata):
        values = []
        for response, m in zip(responses, metadata):
            truth, answered = parse_count(str(m[key])), parse_count(response)
            values.append(0.0 if truth is None or answered is None else max(0.0, 1.0 - abs(answered - truth) / scale))
        return {"count_closeness": torch.tensor(values)}
    return fn


def _check_count_closeness(options: dict, field: str) -> None:
    check_number_option(options, field, "scale", 2.0, lambda v: v > 0,
                        "the count distance at which the credit reaches 0: a positive number")


count_closeness.check_options = _check_count_closeness


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
