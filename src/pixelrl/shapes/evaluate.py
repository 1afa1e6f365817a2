"""The shapes world's GenEval-style evaluation: strict, exact-scene and partial scores per
category from the detector, their bootstrap intervals, and the markdown tables the demo and
`pixelrl eval` print; the OCR evaluation of the text task."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pixelrl.engine.evaluate import generate
from pixelrl.models.base import DiffusionModel
from pixelrl.shapes.careful import REASONS, careful_verdict
from pixelrl.shapes.detector import CATEGORIES, FAILURE_MODES, background_noise, detect, score_detections



def geneval_scores(images: torch.Tensor, items: list[dict]) -> dict:
    """Strict 0/1, exact-scene 0/1 and partial-credit scores per category; `overall` is the mean
    of the category strict scores (GenEval's convention), `overall_exact` the same for exact
    scenes; `extra_objects` is the mean number of unrequested objects per image; `failures` the
    fraction of each category's images in each of the detector's FAILURE_MODES."""
    scores: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in ("strict", "exact", "partial", "careful")}
    per_item = []
    for image, item in zip(images.numpy(), items):
        objects = detect(image)  # one detection for both verdicts
        scene = score_detections(objects, item["metadata"], image.shape[1])
        scene["careful"], careful_reason = careful_verdict(image, item["metadata"], objects)
        for key in scores:
            scores[key][item["category"]].append(float(scene[key]))
        per_item.append({"prompt": item["prompt"], "seed": item.get("seed"), "category": item["category"],
                         "strict": bool(scene["strict"]), "exact": bool(scene["exact"]),
                         "partial": scene["partial"], "extra_objects": scene["extra_objects"],
                         "failure": scene["failure"], "careful": bool(scene["careful"]),
                         "careful_reason": careful_reason})
    categories = [c for c in CATEGORIES if c in scores["strict"]]
    tables = {key: {c: float(np.mean(scores[key][c])) for c in categories} for key in scores}
    failures = {c: {mode: float(np.mean([r["failure"] == mode for r in per_item if r["category"] == c]))
                    for mode in FAILURE_MODES} for c in categories}
    return {
        "strict": tables["strict"],
        "exact": tables["exact"],
        "partial": tables["partial"],
        "overall": float(np.mean(list(tables["strict"].values()))),
        "overall_exact": float(np.mean(list(tables["exact"].values()))),
        "overall_partial": float(np.mean(list(tables["partial"].values()))),
        # the second, stricter judgement (careful.py): its overall, how often it agrees with the
        # strict verdict, and why the images the strict verdict passes fail it
        "careful": tables["careful"],
        "overall_careful": float(np.mean(list(tables["careful"].values()))),
        "agreement": float(np.mean([r["strict"] == r["careful"] for r in per_item])),
        "careful_rejects": {reason: float(np.mean([r["strict"] and r["careful_reason"] == reason for r in per_item]))
                            for reason in REASONS[1:]},
        "extra_objects": float(np.mean([r["extra_objects"] for r in per_item])),
        **background_noise(images),
        "failures": failures,
        "num_images": len(items),
        "items": per_item,
    }


def bootstrap_overall(per_item: list[dict], key: str, *, baseline: list[dict] | None = None,
                      resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval for the overall score (the mean of the category means of
    `key`), resampling items within each category. With `baseline` (the same items, in the same
    order, scored for another model) it is the interval of the paired difference."""
    rng = np.random.default_rng(seed)
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(per_item):
        by_category[row["category"]].append(i)
    values = np.array([float(r[key]) for r in per_item])
    if baseline is not None:
        if [(r["prompt"], r["seed"]) for r in baseline] != [(r["prompt"], r["seed"]) for r in per_item]:
            raise ValueError("a paired interval needs both models scored on the same items in the same order")
        values = values - np.array([float(r[key]) for r in baseline])
    means = np.zeros((resamples, len(by_category)))
    for j, idx in enumerate(by_category.values()):
        picks = rng.integers(0, len(idx), size=(resamples, len(idx)))
        means[:, j] = values[np.array(idx)][picks].mean(axis=1)
    overall = means.mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(overall, tail)), float(np.percentile(overall, 100 - tail))


def evaluate_geneval(model: DiffusionModel, items: list[dict], **generate_kwargs) -> dict:
    images = generate(model, [it["prompt"] for it in items], [it["seed"] for it in items], **generate_kwargs)
    result = geneval_scores(images, items)
    result["images"] = images
    return result


def evaluate_text(model: DiffusionModel, items: list[dict], **generate_kwargs) -> dict:
    """The `ocr` reward of one image per (prompt, seed): its mean (`ocr`), the fraction read
    exactly (`exact`, reward 1), one row per item (for `bootstrap_overall`) and the images."""
    from pixelrl.rewards.ocr import ocr

    prompts = [it["prompt"] for it in items]
    images = generate(model, prompts, [it["seed"] for it in items], **generate_kwargs)
    scores = ocr()(images, prompts, [it.get("metadata", {}) for it in items])["ocr"].tolist()
    rows = [{"prompt": it["prompt"], "seed": it["seed"], "category": it["category"], "ocr": score,
             "exact": float(score == 1.0)} for it, score in zip(items, scores)]
    return {"ocr": float(np.mean(scores)), "exact": float(np.mean([r["exact"] for r in rows])), "items": rows,
            "images": images}


def format_table(result: dict, title: str = "", score: str = "strict") -> str:
    """One markdown row of per-category `score` (strict or exact) with its overall, and the 95%
    interval when `result` holds one (`<score>_interval`)."""
    overall = result["overall" if score == "strict" else f"overall_{score}"]
    return score_table("model" if score == "strict" else f"model ({score})", title, overall,
                       result.get(f"{score}_interval"), result[score])


def score_table(head: str, title: str, overall: float, interval, columns: dict[str, float]) -> str:
    """A markdown header, rule and one row: `title`, the overall (with its interval when given)
    and one column per group."""
    cell = f"{overall:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval is not None else "")
    rule = "|---" * (len(columns) + 2) + "|"
    row = f"| {title} | {cell} | " + " | ".join(f"{v:.3f}" for v in columns.values()) + " |"
    return "\n".join([f"| {head} | overall | " + " | ".join(columns) + " |", rule, row])


def format_careful(result: dict, baseline: dict | None = None) -> str:
    """The second, stricter judgement of `result` (careful.py) in one line: its overall with a 95%
    interval (with `baseline`, the same items scored for another model: both, and the paired gain),
    how often it agrees with the strict verdict, and why it rejects images the strict verdict passes."""
    low, high = bootstrap_overall(result["items"], "careful")
    rejects = ", ".join(f"{reason} {share:.1%}" for reason, share in result["careful_rejects"].items() if share)
    if baseline is None:
        return (f"careful judge (stricter, evaluation only): {result['overall_careful']:.3f} [{low:.3f}, {high:.3f}]; "
                f"agrees with the strict verdict on {result['agreement']:.1%} of images; strict passes it rejects: "
                f"{rejects or 'none'}")
    gain_low, gain_high = bootstrap_overall(result["items"], "careful", baseline=baseline["items"])
    return (f"careful judge (stricter, evaluation only): {baseline['overall_careful']:.3f} -> "
            f"{result['overall_careful']:.3f} ({result['overall_careful'] - baseline['overall_careful']:+.3f}, paired "
            f"95% interval [{gain_low:+.3f}, {gain_high:+.3f}]); agrees with the strict verdict on "
            f"{baseline['agreement']:.1%} -> {result['agreement']:.1%} of images; strict passes it rejects after "
            f"training: {rejects or 'none'}")


def format_failures(before: dict, after: dict | None = None) -> str:
    """A markdown table of what went wrong, per category: the fraction of its images in each
    failure mode (`failures` of `geneval_scores`), as `before -> after` when two results are given."""
    cats = list(before["failures"])
    head = "| category | " + " | ".join(FAILURE_MODES) + " |"
    rows = [head, "|---" * (len(FAILURE_MODES) + 1) + "|"]
    for c in cats:
        cells = [f"{before['failures'][c][m]:.2f}" + (f" -> {after['failures'][c][m]:.2f}" if after else "")
                 for m in FAILURE_MODES]
        rows.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
