"""`shapes_geneval`: a GenEval-style detector for the procedural shapes world.

The world: 1 to 4 flat shapes (circle, square, triangle) in 6 saturated colours on black.
The detector segments pixels by colour (hue of bright pixels), takes connected components per
colour, classifies each component's shape by how much of its bounding box it fills (square
1.0, circle pi/4, triangle 1/2), and checks the prompt's requirements: counts, colours and
relative positions.

Prompt metadata (what the prompt asks for), JSON-friendly:
    {"category": "position",
     "objects": [{"shape": "circle", "colour": null, "count": 1}, ...],
     "relation": {"type": "left_of", "a": 0, "b": 1} | null}
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
import torch

from pixelrl.rewards.registry import register_reward

SHAPES = ("circle", "square", "triangle")
# Saturated colours spread around the hue circle; rendered on black.
COLOURS = {
    "red": (220, 30, 30),
    "yellow": (225, 205, 25),
    "green": (30, 190, 40),
    "cyan": (25, 195, 215),
    "blue": (40, 70, 235),
    "purple": (190, 40, 215),
}
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS = {"left_of": "to the left of", "right_of": "to the right of", "above": "above", "below": "below"}
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

_PALETTE_HUES = {name: colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] for name, rgb in COLOURS.items()}

FOREGROUND_VALUE = 0.25  # a pixel is part of an object when its brightest channel exceeds this
MIN_SATURATION = 0.35
MIN_AREA = 6  # components smaller than this (in pixels at 32 px) are specks, not objects
POSITION_MARGIN = 0.06  # fraction of the image width a centroid must clear to count as left/right/above/below


@dataclass
class Detection:
    shape: str
    colour: str
    area: int
    cx: float  # centroid, in pixels
    cy: float
    fill: float  # covered area / soft bounding-box area


def _hue_distance(a: float, b: float) -> float:
    d = abs(a - b) % 1.0
    return min(d, 1.0 - d)


def colour_map(image: np.ndarray) -> np.ndarray:
    """Per pixel: index into COLOURS of the nearest palette hue, or -1 for background."""
    rgb = image.astype(np.float32) / 255.0
    value = rgb.max(axis=-1)
    low = rgb.min(axis=-1)
    saturation = np.where(value > 0, (value - low) / np.maximum(value, 1e-6), 0.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    delta = np.maximum(value - low, 1e-6)
    hue = np.where(value == r, ((g - b) / delta) % 6, np.where(value == g, (b - r) / delta + 2, (r - g) / delta + 4)) / 6
    hues = np.array(list(_PALETTE_HUES.values()), dtype=np.float32)
    diff = np.abs(hue[..., None] - hues) % 1.0
    nearest = np.minimum(diff, 1.0 - diff).argmin(axis=-1)
    foreground = (value > FOREGROUND_VALUE) & (saturation > MIN_SATURATION)
    return np.where(foreground, nearest, -1)


def classify_shape(fill: float, drop: float) -> str:
    """Shape from two scale-free features of the soft (anti-aliased) mask.

    `fill`: covered area / (soft width x soft height): square 1, circle pi/4, triangle 1/2.
    `drop`: how far the centroid sits below the box centre, in box heights: an upward
    triangle puts 2/3 of its mass in the lower half (1/6), circles and squares 0.
    """
    # Thresholds sit midway between the measured ranges on renders (circle fill 0.75-0.85,
    # square 0.99-1.0, triangle 0.54-0.64).
    if fill < 0.69 or drop > 0.09:
        return "triangle"
    if fill >= 0.92:
        return "square"
    return "circle"


def detect(image: np.ndarray, min_area: int | None = None) -> list[Detection]:
    """Objects in one uint8 RGB image [H, W, 3]."""
    from scipy import ndimage

    size = image.shape[0]
    min_area = min_area if min_area is not None else max(2, round(MIN_AREA * (size / 32) ** 2))
    labels_by_colour = colour_map(image)
    value = image.astype(np.float32).max(axis=-1) / 255.0
    found = []
    for colour_index, colour in enumerate(COLOURS):
        mask = labels_by_colour == colour_index
        if not mask.any():
            continue
        components, count = ndimage.label(mask, structure=np.ones((3, 3)))
        for label in range(1, count + 1):
            member = components == label
            ys, xs = np.nonzero(member)
            if len(xs) < min_area:
                continue
            # Coverage of each pixel: its brightness relative to the object's solid interior,
            # so that anti-aliased or blurred edges count fractionally.
            solid = np.percentile(value[member], 90)
            coverage = np.where(member, np.clip(value / max(solid, 1e-6), 0, 1), 0.0)
            area = float(coverage.sum())
            width = float(coverage.max(axis=0).sum())
            height = float(coverage.max(axis=1).sum())
            cx = float((coverage.sum(axis=0) * np.arange(size)).sum() / area)
            cy = float((coverage.sum(axis=1) * np.arange(size)).sum() / area)
            fill = area / max(width * height, 1e-6)
            top = ys.min() - 0.5 + (1 - coverage[ys.min()].max())  # sub-pixel top edge
            bottom = ys.max() + 0.5 - (1 - coverage[ys.max()].max())
            drop = (cy - (top + bottom) / 2) / max(bottom - top, 1e-6)
            found.append(Detection(classify_shape(fill, drop), colour, len(xs), cx, cy, fill))
    return found


def _relation_holds(kind: str, a: Detection, b: Detection, margin: float) -> bool:
    if kind == "left_of":
        return a.cx + margin < b.cx
    if kind == "right_of":
        return a.cx > b.cx + margin
    if kind == "above":
        return a.cy + margin < b.cy
    if kind == "below":
        return a.cy > b.cy + margin
    raise ValueError(f"unknown relation {kind!r}")


def score_image(image: np.ndarray, spec: dict) -> tuple[float, bool, dict]:
    """(partial-credit score in [0, 1], strict pass, sub-scores) of one image against its spec.

    Sub-scores: one count score per requested object (exact with partial credit
    1 - |n_req - n| / n_req for `counting`, at-least min(n, n_req) / n_req otherwise), one
    colour score per object whose colour is given, one position score for a relation. The
    training reward is their mean; strict means every one is 1.
    """
    detections = detect(image)
    subs: dict[str, float] = {}
    matches = []
    for i, obj in enumerate(spec["objects"]):
        of_shape = [d for d in detections if d.shape == obj["shape"]]
        wanted = obj["count"]
        if obj.get("colour"):
            coloured = [d for d in of_shape if d.colour == obj["colour"]]
        else:
            coloured = of_shape
        if spec["category"] == "counting":
            n = len(coloured)
            subs[f"count_{i}"] = max(0.0, 1.0 - abs(wanted - n) / wanted)
        else:
            subs[f"count_{i}"] = min(len(of_shape), wanted) / wanted
            if obj.get("colour"):
                subs[f"colour_{i}"] = 1.0 if coloured else 0.0
        matches.append(coloured)
    relation = spec.get("relation")
    if relation:
        margin = POSITION_MARGIN * image.shape[1]
        ok = any(_relation_holds(relation["type"], a, b, margin)
                 for a in matches[relation["a"]] for b in matches[relation["b"]])
        subs["position"] = 1.0 if ok else 0.0
    partial = float(np.mean(list(subs.values())))
    strict = all(v == 1.0 for v in subs.values())
    return partial, strict, subs


@register_reward("shapes_geneval")
def shapes_geneval(strict_weight: float = 0.0):
    """Training reward: (1 - w) * partial credit + w * strict. Also returns the strict 0/1
    score as `shapes_strict` for logging and evaluation."""

    def reward(images, prompts, metadata):
        arrays = images.detach().cpu().numpy()
        partial, strict = [], []
        for array, meta in zip(arrays, metadata):
            if not meta or "objects" not in meta:
                raise ValueError("shapes_geneval needs each prompt's metadata (objects, relation, category)")
            p, s, _ = score_image(array, meta)
            partial.append(p)
            strict.append(float(s))
        partial_t, strict_t = torch.tensor(partial), torch.tensor(strict)
        return {"shapes_geneval": (1 - strict_weight) * partial_t + strict_weight * strict_t,
                "shapes_strict": strict_t}

    return reward
