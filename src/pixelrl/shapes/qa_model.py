"""Pretraining of the shipped shapes-QA vision-language model (`builtin:shapes_qa_vlm`).

A tiny Qwen2-VL learns from scratch to answer shapes-QA questions with one word. The run stops
early on purpose: the shipped model must leave room for RL (held-out accuracy between about 0.3
and 0.6), so `steps` is part of the recipe.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pixelrl.engine.learner import Learner
from pixelrl.models.qwen_vl import QwenVLModel
from pixelrl.models.qwen_vl.tiny import SHAPES_QA_ARCH, build_tiny_qwen_vl
from pixelrl.shapes import qa as shapes_qa
from pixelrl.vlm.pretrain import evaluate_qa, save_vlm, sft_loss


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
            record = {"step": step, "minutes": round((time.time() - start) / 60, 2), **evaluate_qa(model, val, shapes_qa.QUESTION_TYPES)}
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
