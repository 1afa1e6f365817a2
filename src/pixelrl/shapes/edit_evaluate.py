"""The shapes-editing world's evaluation: per kind of edit, the share of edits that succeed
(`exact`: the instruction followed, everything else kept, nothing added), that follow the
instruction, the share of untouched objects kept in place, the careful verdict, pixel
preservation of the source; bootstrap intervals; the markdown table the demo prints."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pixelrl.engine.evaluate import generate
from pixelrl.shapes import edit_world
from pixelrl.shapes.careful import careful_verdict
from pixelrl.shapes.detector import detect
from pixelrl.shapes.evaluate import score_table

SCORES = ("exact", "followed", "kept", "careful", "partial", "pixels_kept")


def edit_inputs(items: list[dict]) -> tuple[list[torch.Tensor], list[dict]]:
    """Each item's source image (uint8 [32, 32, 3]) and metadata, from its instruction and seed."""
    sources, metadata = [], []
    for item in items:
        source, _, meta = edit_world.edit_triple(item, item["seed"])
        sources.append(torch.from_numpy(source))
        metadata.append(meta)
    return sources, metadata


def judge_edit(image: np.ndarray, metadata: dict, source: np.ndarray) -> dict:
    """Every score of one result: `edit_world.score_detections`' verdicts, the careful judge's
    (careful.py, with the edit's own verdict on the objects it accepts) and `pixels_kept`,
    1 - mean |result - source| / 255 (the `source_preservation` reward)."""
    objects = detect(image)
    scene = edit_world.score_detections(objects, metadata, image.shape[1])

    def lenient(found, width):
        verdict = edit_world.score_detections(found, metadata, width)
        return {"exact": verdict["exact"], "strict": verdict["followed"] and verdict["kept"] == 1.0}

    scene["careful"], scene["careful_reason"] = careful_verdict(image, {}, objects, judge=lenient)
    scene["pixels_kept"] = 1.0 - float(np.abs(image.astype(np.float32) - source.astype(np.float32)).mean()) / 255
    return scene


def edit_scores(images: torch.Tensor, items: list[dict], sources: list[torch.Tensor], metadata: list[dict]) -> dict:
    """Per kind of edit and overall (the mean of the kinds, as GenEval's overall): each of SCORES;
    `items`: one row per image (for `bootstrap_overall`, the kind of edit as its category)."""
    rows = []
    for image, item, source, meta in zip(images.numpy(), items, sources, metadata):
        scene = judge_edit(image, meta, source.numpy())
        rows.append({"prompt": item["prompt"], "seed": item["seed"], "category": item["edit"],
                     **{key: float(scene[key]) for key in SCORES}, "careful_reason": scene["careful_reason"],
                     "extra_objects": scene["extra_objects"]})
    kinds = [e for e in edit_world.EDITS if any(r["category"] == e for r in rows)]
    result: dict = {"num_images": len(rows), "items": rows}
    for key in SCORES:
        result[f"{key}_by_edit"] = {e: float(np.mean([r[key] for r in rows if r["category"] == e])) for e in kinds}
        result[key] = float(np.mean(list(result[f"{key}_by_edit"].values())))
    return result


def evaluate_edits(model, items: list[dict], *, num_steps: int = 10, guidance_scale: float = 1.0, **kwargs) -> dict:
    """Edit each item's source by its instruction (ODE sampling, one image per item seed) and
    score the results (`edit_scores`); the result holds the images and the sources."""
    sources, metadata = edit_inputs(items)
    images = generate(model, [it["prompt"] for it in items], [it["seed"] for it in items], num_steps=num_steps,
                      guidance_scale=guidance_scale, condition_images=[(s,) for s in sources], **kwargs)
    result = edit_scores(images, items, sources, metadata)
    result.update(images=images, sources=torch.stack(sources))
    return result


def format_edit_table(result: dict, title: str, score: str = "exact") -> str:
    """One markdown row of `score` per kind of edit with its overall (and its interval when
    `result` holds `<score>_interval`)."""
    return score_table(f"model ({score})", title, result[score], result.get(f"{score}_interval"),
                       result[f"{score}_by_edit"])


def careful_reasons(result: dict) -> dict[str, float]:
    """Why the careful judge rejects the edits the lenient verdict passes: each reason's share of images."""
    counts: dict[str, int] = defaultdict(int)
    for row in result["items"]:
        if row["exact"] and not row["careful"]:
            counts[row["careful_reason"]] += 1
    return {reason: n / max(len(result["items"]), 1) for reason, n in counts.items()}
