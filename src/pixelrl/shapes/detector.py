"""`shapes_geneval`: a GenEval-style detector for the procedural shapes world.

The world: 1 to 4 flat shapes (circle, square, triangle) in 6 saturated colours on black.
The detector segments pixels by colour (hue of bright, saturated pixels), takes connected
components per colour, and classifies each component by its soft IoU with the ideal circle,
square and triangle filling the same box; a component that matches none (IoU < 0.6) is an
`unknown` blob. It then checks the prompt's requirements: counts, colours and relative
positions.

Prompt metadata (what the prompt asks for), JSON-friendly:
    {"category": "position",
     "objects": [{"shape": "circle", "colour": null, "count": 1}, ...],
     "relation": {"type": "left_of", "a": 0, "b": 1} | null}
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, field

import numpy as np
import torch

from pixelrl.rewards.registry import check_number_option, register_reward

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
MIN_SHAPE_IOU = 0.6  # below this a component is an `unknown` blob, not a shape
POSITION_MARGIN = 0.06  # fraction of the image width a centroid must clear to count as left/right/above/below


@dataclass
class Detection:
    shape: str
    colour: str
    area: int
    cx: float  # centroid, in pixels
    cy: float
    fill: float  # covered area / soft bounding-box area
    iou: float  # soft IoU with the best-matching ideal shape
    touches_border: bool = False  # a pixel in the image's outermost row or column: cut off
    hue_error: float = 0.0  # median distance of its pixels' hue from its palette hue (fraction of the circle)
    member: np.ndarray | None = field(default=None, repr=False, compare=False)  # its pixels, [H, W] bool


def colour_map(image: np.ndarray) -> np.ndarray:
    """Per pixel: index into COLOURS of the nearest palette hue, or -1 for background."""
    return _colours_and_hue_errors(image)[0]


def _colours_and_hue_errors(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`colour_map`, and each pixel's hue distance from the palette hue it was given."""
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
    return np.where(foreground, nearest, -1), np.minimum(diff, 1.0 - diff).min(axis=-1)


SUPERSAMPLE = 4  # sub-pixels per pixel side of an ideal shape's coverage


def ideal_coverages(left: float, top: float, side_w: float, side_h: float, size: int) -> dict[str, np.ndarray]:
    """Anti-aliased coverage [size, size] of each ideal shape filling the box (the renderer's
    shapes: a disc, a square, an upward isosceles triangle), from SUPERSAMPLE^2 samples a pixel.
    The box coordinates are built once for the three (the reward's hottest loop: every
    component of every sampled image)."""
    ss = SUPERSAMPLE
    centres = (np.arange(size * ss) + 0.5) / ss
    u = ((centres - left) / side_w)[None, :]  # box coordinates in [0, 1], a row and a column
    v = ((centres - top) / side_h)[:, None]
    inside = {"circle": (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25,
              "square": (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1),
              "triangle": (v >= 0) & (v <= 1) & (np.abs(u - 0.5) <= v / 2)}
    # sub-pixels counted a row of pixels at a time, then a pixel at a time (twice as fast as one
    # sum over both axes), over ss^2: the mean exactly
    return {shape: mask.reshape(size, ss, size * ss).sum(axis=1).reshape(size, size, ss).sum(axis=2) / (ss * ss)
            for shape, mask in inside.items()}


def classify_shape(coverage: np.ndarray, left: float, top: float, width: float, height: float) -> tuple[str, float]:
    """Best-matching ideal shape and its soft IoU with the component's coverage.

    A component that matches no shape well (a blob, two merged objects, a smear) is `unknown`:
    it is an object, but of no requested shape.
    """
    best, best_iou = "unknown", 0.0
    ideals = ideal_coverages(left, top, width, height, coverage.shape[0])
    for shape in SHAPES:
        ideal = ideals[shape]
        iou = float(np.minimum(coverage, ideal).sum() / max(np.maximum(coverage, ideal).sum(), 1e-6))
        if iou > best_iou:
            best, best_iou = shape, iou
    if best_iou < MIN_SHAPE_IOU:
        return "unknown", best_iou
    return best, best_iou


def detect(image: np.ndarray, min_area: int | None = None) -> list[Detection]:
    """Objects in one uint8 RGB image [H, W, 3]."""
    from scipy import ndimage

    size = image.shape[0]
    min_area = min_area if min_area is not None else max(2, round(MIN_AREA * (size / 32) ** 2))
    labels_by_colour, hue_errors = _colours_and_hue_errors(image)
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
            # Sub-pixel box: the outermost rows/columns count by how much of them is covered.
            col, row = coverage.max(axis=0), coverage.max(axis=1)
            left = xs.min() + (1 - col[xs.min()])
            right = xs.max() + col[xs.max()]
            top = ys.min() + (1 - row[ys.min()])
            bottom = ys.max() + row[ys.max()]
            width, height = max(right - left, 1e-3), max(bottom - top, 1e-3)
            cx = float((coverage.sum(axis=0) * (np.arange(size) + 0.5)).sum() / area)
            cy = float((coverage.sum(axis=1) * (np.arange(size) + 0.5)).sum() / area)
            shape, iou = classify_shape(coverage, left, top, width, height)
            border = xs.min() == 0 or ys.min() == 0 or xs.max() == size - 1 or ys.max() == size - 1
            found.append(Detection(shape, colour, len(xs), cx, cy, area / (width * height), iou, bool(border),
                                   float(np.median(hue_errors[member])), member))
    return found


def relation_holds(kind: str, a, b, margin: float) -> bool:
    """Whether `a` stands in relation `kind` to `b` (anything with centroids .cx, .cy)."""
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
    scene = score_scene(image, spec)
    return scene["partial"], scene["strict"], scene["subs"]


def score_scene(image: np.ndarray, spec: dict) -> dict:
    """Every score of one image: `partial`, `strict` and `subs` as in `score_image`, plus

    - `extra_objects`: detected objects that fill no requested slot: a requested object's
      surplus copies, objects of other shapes or colours, `unknown` blobs;
    - `surplus_objects`: detected objects beyond the number the prompt asks for (the sum of
      its counts), whatever they are: a wrong shape drawn in place of a requested one is an
      extra object but not a surplus one;
    - `object_count`: how close the number of detected objects n is to that number N,
      max(0, 1 - |n - N| / N), whatever the objects are;
    - `exact`: strict, and nothing else in the image (`extra_objects` == 0). GenEval's
      "at least" checks pass a scene with added objects; this does not.
    """
    return score_detections(detect(image), spec, image.shape[1])


def score_detections(detections: list[Detection], spec: dict, width: int) -> dict:
    """`score_scene` of objects already detected in an image `width` pixels wide."""
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
        margin = POSITION_MARGIN * width
        ok = any(relation_holds(relation["type"], a, b, margin)
                 for a in matches[relation["a"]] for b in matches[relation["b"]])
        subs["position"] = 1.0 if ok else 0.0
    # each requested object takes up to its count of matching detections, in spec order
    assigned: set[int] = set()
    for obj, found in zip(spec["objects"], matches):
        free = [d for d in found if id(d) not in assigned]
        assigned.update(id(d) for d in free[:obj["count"]])
    extra = len(detections) - len(assigned)
    strict = all(v == 1.0 for v in subs.values())
    asked = sum(obj["count"] for obj in spec["objects"])
    surplus = max(0, len(detections) - asked)
    return {"partial": float(np.mean(list(subs.values()))), "strict": strict, "subs": subs,
            "extra_objects": extra, "surplus_objects": surplus,
            "object_count": max(0.0, 1.0 - abs(len(detections) - asked) / asked), "exact": strict and extra == 0,
            "failure": failure_mode(spec, detections, subs, strict, extra, asked)}


FAILURE_MODES = ("exact", "extra", "too_few", "too_many", "repeated_shape", "wrong_object", "relation")


def failure_mode(spec: dict, detections: list[Detection], subs: dict[str, float], strict: bool, extra: int,
                 asked: int) -> str:
    """What went wrong in one image, one of FAILURE_MODES:

    - `exact`: nothing; `extra`: strict, with unrequested objects besides;
    - `too_few` / `too_many`: fewer / more objects than the prompt asks for (`asked`, the sum of
      its counts);
    - with as many objects as asked: `relation` (the right objects, the relation fails),
      `repeated_shape` (only requested shapes, but one drawn in place of another: "a circle and a
      square" drawn as two circles), `wrong_object` (anything else: a blob, another shape, a wrong
      colour).
    """
    if strict:
        return "exact" if extra == 0 else "extra"
    if len(detections) != asked:
        return "too_few" if len(detections) < asked else "too_many"
    if all(v == 1.0 for k, v in subs.items() if k != "position"):
        return "relation"
    requested = {obj["shape"] for obj in spec["objects"]}
    drawn = {d.shape for d in detections}
    if drawn < requested:
        return "repeated_shape"
    return "wrong_object"


# a background pixel is one whose brightest channel stays below this (the shapes are drawn bright on
# black); grain shows as background pixels brighter than BACKGROUND_SPECK
BACKGROUND_BELOW, BACKGROUND_SPECK = 48, 12


def background_noise(images: torch.Tensor) -> dict[str, float]:
    """How clean the black background is, over uint8 images [B, H, W, 3]: the mean level (0-255) of
    the background pixels' brightest channel, and the share of them brighter than BACKGROUND_SPECK.
    Grain a detector ignores (it counts shapes, and the careful judge only bright specks) shows
    here: a clean render scores 0 and 0."""
    level = images.to(torch.int16).amax(dim=-1)
    background = level < BACKGROUND_BELOW
    count = max(int(background.sum()), 1)
    return {"background_level": float(level[background].float().sum()) / count,
            "background_specks": float((background & (level > BACKGROUND_SPECK)).sum()) / count}


@register_reward("shapes_geneval")
def shapes_geneval(strict_weight: float = 0.0, extra_object_penalty: float = 0.0, exact_weight: float = 0.0,
                   surplus_object_penalty: float = 0.0, object_count_weight: float = 0.0,
                   background_penalty: float = 0.0):
    """Training reward: (1 - w - e) * partial credit + w * strict + e * exact - p * (unrequested
    objects) - q * (surplus objects) + k * (object count score). Also returns `shapes_strict`,
    `shapes_exact` (0/1), `shapes_extra_objects` and `shapes_surplus_objects` for logging and
    evaluation. The penalties and the exact-scene weight e guard against the policy's cheapest
    hack of GenEval-style checks: drawing more objects than asked. p charges each object that
    fills no requested slot, so a failed attempt at a requested object (a blob, a wrong shape)
    costs more than leaving it out; q charges only objects beyond the number asked for, which the
    hack needs and an attempt does not; e pays the full-marks bonus only for a scene with nothing
    extra. k pays for drawing as many objects as asked, right or wrong, so that a failed attempt
    at a second object can earn more than leaving it out (docs/shapes.md measures each).
    `background_penalty` b subtracts b x the image's background level / 255 (`background_noise`):
    grain below the detector's threshold, which no other term sees."""
    def reward(images, prompts, metadata):
        arrays = images.detach().cpu().numpy()
        rows = []
        for array, meta in zip(arrays, metadata):
            if not meta or "objects" not in meta:
                raise ValueError("shapes_geneval needs each prompt's metadata (objects, relation, category)")
            rows.append(score_scene(array, meta))
        column = lambda key: torch.tensor([float(r[key]) for r in rows])  # noqa: E731
        partial, strict, extra = column("partial"), column("strict"), column("extra_objects")
        exact, surplus = column("exact"), column("surplus_objects")
        score = ((1 - strict_weight - exact_weight) * partial + strict_weight * strict + exact_weight * exact
                 - extra_object_penalty * extra - surplus_object_penalty * surplus
                 + object_count_weight * column("object_count"))
        if background_penalty:
            levels = torch.tensor([background_noise(image[None])["background_level"] for image in images.detach().cpu()])
            score = score - background_penalty * levels / 255
        return {"shapes_geneval": score, "shapes_strict": strict, "shapes_exact": exact, "shapes_extra_objects": extra,
                "shapes_surplus_objects": surplus}

    return reward


def _check_shapes_geneval(options: dict, field: str) -> None:
    check_number_option(options, field, "strict_weight", 0.0, lambda v: 0 <= v <= 1,
                        "a number in [0, 1]: the weight of the strict 0/1 score")
    check_number_option(options, field, "extra_object_penalty", 0.0, lambda v: 0 <= v < float("inf"),
                        "a number >= 0: reward subtracted per unrequested object (0 = off; 0.1-0.3 guards)")
    check_number_option(options, field, "surplus_object_penalty", 0.0, lambda v: 0 <= v < float("inf"),
                        "a number >= 0: reward subtracted per object beyond the number the prompt asks for (0 = off)")
    check_number_option(options, field, "object_count_weight", 0.0, lambda v: 0 <= v < float("inf"),
                        "a number >= 0: reward for drawing as many objects as the prompt asks for (0 = off)")
    check_number_option(options, field, "background_penalty", 0.0, lambda v: 0 <= v < float("inf"),
                        "a number >= 0: reward subtracted per unit of background level / 255 (0 = off)")
    strict_weight = options.get("strict_weight", 0.0)
    check_number_option(options, field, "exact_weight", 0.0, lambda v: 0 <= v <= 1 - strict_weight,
                        f"a number in [0, 1 - strict_weight] = [0, {1 - strict_weight:g}]: the weight of the "
                        "exact-scene 0/1 score (the weights of partial credit, strict and exact sum to 1)")


shapes_geneval.check_options = _check_shapes_geneval


def scene_metadata_problem(metadata: dict) -> str:
    """What a row's metadata lacks for shapes_geneval to score its image ("" when nothing): the
    prompt's `category` and its `objects`, each {shape, colour, count} (`relation` optional)."""
    objects = metadata.get("objects")
    if not isinstance(objects, list) or not objects:
        return "no `objects` list (each {shape, colour, count})"
    for obj in objects:
        if not isinstance(obj, dict) or not {"shape", "colour", "count"} <= set(obj):
            return f"an object without shape, colour and count ({obj!r})"
    if "category" not in metadata:
        return "no `category` (single_object, two_object, counting, colors, position or color_attr)"
    return ""


shapes_geneval.metadata_problem = scene_metadata_problem
