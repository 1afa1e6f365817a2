"""Supervised fine-tuning and greedy-answer evaluation of a vision-language model: the answer's
tokens and the end-of-sequence token are the targets, the prompt (image and question) is masked
out. The shapes world pretrains its shipped QA model with these (`pixelrl.shapes.qa_model`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pixelrl.models.qwen_vl import QwenVLModel
from pixelrl.vlm.answers import extract_answer, normalise_answer


@torch.no_grad()
def answer_correctness(model: QwenVLModel, items: list[dict], *, batch_size: int = 64, max_new_tokens: int = 4,
                       module: torch.nn.Module | None = None, extract: str = "whole") -> list[tuple[str, str, float]]:
    """(question type, right answer, 1.0 if the greedy answer is right) for each item; the answer is
    read from the response as `answer_match` reads it (`extract_answer`)."""
    out = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        prompts = model.prompts([it["image"] for it in chunk], [it["question"] for it in chunk])
        answers = model.decode(model.generate(prompts, seed=0, temperature=0.0, max_new_tokens=max_new_tokens,
                                              module=module))
        for it, response in zip(chunk, answers):
            answer = extract_answer(response, extract)
            right = answer is not None and normalise_answer(answer) == normalise_answer(str(it["answer"]))
            out.append((it["type"], it["answer"], float(right)))
    return out


def summarise_correctness(results: list[tuple[str, str, float]], types: tuple[str, ...] = ()) -> dict:
    """Accuracy overall and per question type, and balanced accuracy: per type the mean, over the
    right answers, of the accuracy on the questions with that answer; overall the mean over types.

    Balanced accuracy is what tells learning from a policy that gives one answer to every question
    of a type: that policy scores exactly 1/K (K answers) however the held-out answers happen to
    be distributed, where its plain accuracy is the share of its answer (0.57 for "yes" on the
    first 300 test questions)."""
    # `types` first in their order (a task's own, e.g. shapes-QA's), then any others as they come
    correct: dict[str, list[float]] = {t: [] for t in types}
    by_answer: dict[str, dict[str, list[float]]] = {t: {} for t in types}
    for kind, answer, ok in results:
        correct.setdefault(kind, []).append(ok)
        by_answer.setdefault(kind, {}).setdefault(answer, []).append(ok)
    per_type = {t: sum(v) / len(v) for t, v in correct.items() if v}
    balanced = {t: sum(sum(v) / len(v) for v in groups.values()) / len(groups)
                for t, groups in by_answer.items() if groups}
    return {"accuracy": sum(ok for *_, ok in results) / len(results),
            **{f"accuracy_{t}": a for t, a in per_type.items()},
            "balanced_accuracy": sum(balanced.values()) / len(balanced),
            **{f"balanced_accuracy_{t}": a for t, a in balanced.items()}}


def evaluate_qa(model: QwenVLModel, items: list[dict], types: tuple[str, ...] = (), **kwargs) -> dict:
    """Greedy-decoding accuracy on `items`: overall and per question type (`types` first)."""
    return summarise_correctness(answer_correctness(model, items, **kwargs), types)


def sft_loss(model: QwenVLModel, chunk: list[dict]) -> torch.Tensor:
    """Mean negative log-likelihood of the answers (answer tokens and EOS) given image and question."""
    batch = model.with_responses(model.prompts([it["image"] for it in chunk], [it["question"] for it in chunk]),
                                 [it["answer"] for it in chunk])
    logp = model.token_logprobs(batch)
    return -(logp.sum() / batch.response_mask.sum())


def save_vlm(model: QwenVLModel, out: Path) -> None:
    """Write the model with its tokenizer and image processor (atomic rename)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.model.save_pretrained(tmp)
    model.tokenizer.save_pretrained(tmp)
    model.image_processor.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
