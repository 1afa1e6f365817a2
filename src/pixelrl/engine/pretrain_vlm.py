"""Supervised pretraining of the shipped shapes-QA vision-language model, and its evaluation.

A tiny Qwen2-VL learns from scratch to answer shapes-QA questions with one word: cross-entropy on
the answer token and the end-of-sequence token, the prompt (image and question) masked out.
The run stops early on purpose: the shipped model must leave room for RL (held-out accuracy
between about 0.3 and 0.6), so `steps` is part of the recipe.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from pixelrl.data import shapes_qa
from pixelrl.engine.learner import Learner
from pixelrl.models.qwen_vl import QwenVLModel
from pixelrl.models.qwen_vl.tiny import SHAPES_QA_ARCH, build_tiny_qwen_vl
from pixelrl.rewards.answers import extract_answer, normalise_answer


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


def summarise_correctness(results: list[tuple[str, str, float]]) -> dict:
    """Accuracy overall and per question type, and balanced accuracy: per type the mean, over the
    right answers, of the accuracy on the questions with that answer; overall the mean over types.

    Balanced accuracy is what tells learning from a policy that gives one answer to every question
    of a type: that policy scores exactly 1/K (K answers) however the held-out answers happen to
    be distributed, where its plain accuracy is the share of its answer (0.57 for "yes" on the
    first 300 test questions)."""
    # types in shapes-QA's order, then any others (a question file's own types) as they come
    correct: dict[str, list[float]] = {t: [] for t in shapes_qa.QUESTION_TYPES}
    by_answer: dict[str, dict[str, list[float]]] = {t: {} for t in shapes_qa.QUESTION_TYPES}
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


def evaluate_qa(model: QwenVLModel, items: list[dict], **kwargs) -> dict:
    """Greedy-decoding accuracy on shapes-QA `items`: overall and per question type."""
    return summarise_correctness(answer_correctness(model, items, **kwargs))


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


def pretrain_shapes_qa(out_dir: str | Path, *, steps: int = 3000, seed: int = 0, batch_size: int = 64,
                       lr: float = 1e-3, warmup: int = 100, eval_every: int = 250, eval_items: int = 600,
                       arch: dict | None = None, log=print) -> Path:
    """Train for `steps` optimizer steps on fresh train items (every item is seen once), evaluate
    held-out accuracy on `eval_items` val items and save every `eval_every` steps.
    Returns the final model folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    init = out / "init"
    if not (init / "config.json").is_file():
        build_tiny_qwen_vl(init, words=shapes_qa.vocabulary(), seed=seed, **(arch or SHAPES_QA_ARCH))
    torch.manual_seed(seed)
    model = QwenVLModel(init)
    params = [p for p in model.model.parameters()]
    log(f"parameters: {sum(p.numel() for p in params)}")
    learner = Learner(lambda: params, lr=lr, weight_decay=0.0, warmup_steps=warmup, max_grad_norm=1.0)
    val = shapes_qa.items("val", 0, eval_items)
    log_file = (out / "pretrain_log.jsonl").open("a")
    start, step = time.time(), 0
    while True:
        if step % eval_every == 0 or step == steps:
            model.model.eval()
            record = {"step": step, "minutes": round((time.time() - start) / 60, 2), **evaluate_qa(model, val)}
            log(json.dumps(record))
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            save_vlm(model, out / "checkpoints" / f"step_{step:06d}")
            if step >= steps:
                break
        model.model.train()
        loss = sft_loss(model, shapes_qa.items("train", step * batch_size, batch_size))
        loss.backward()
        learner.step(float(loss.detach()))
        step += 1
        if step % 50 == 0:
            log_file.write(json.dumps({"step": step, "loss": float(loss.detach()),
                                       "minutes": round((time.time() - start) / 60, 2)}) + "\n")
            log_file.flush()
    final = out / "final"
    save_vlm(model, final)
    return final
