"""The procedural shapes world: prompts in GenEval's six categories and a deterministic renderer.

`render(spec, seed)` draws a scene that satisfies a prompt's metadata (see
`pixelrl.shapes.detector`): objects of the requested shapes, colours and counts, placed without
overlap, satisfying any relation with a clear margin. Unspecified colours are drawn at random.
Shapes are drawn at 4x and box-filtered down, so edges are anti-aliased like a generated image.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from pixelrl.shapes.detector import CATEGORIES, COLOURS, NUMBERS, RELATIONS, SHAPES, relation_holds

SUPERSAMPLE = 4


def _plural(shape: str) -> str:
    return shape + "s"


def _obj(shape, colour=None, count=1) -> dict:
    return {"shape": shape, "colour": colour, "count": count}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def all_prompts() -> dict[str, list[dict]]:
    """Every prompt of every category, each as {prompt, category, metadata}."""
    out: dict[str, list[dict]] = {c: [] for c in CATEGORIES}

    def add(category, prompt, objects, relation=None):
        out[category].append({"prompt": prompt, "category": category,
                              "metadata": {"category": category, "objects": objects, "relation": relation}})

    for s in SHAPES:
        add("single_object", f"a {s}", [_obj(s)])
    for s1, s2 in itertools.permutations(SHAPES, 2):
        add("two_object", f"a {s1} and a {s2}", [_obj(s1), _obj(s2)])
    for n, s, c in itertools.product((2, 3, 4), SHAPES, COLOURS):
        add("counting", f"{NUMBERS[n]} {c} {_plural(s)}", [_obj(s, c, n)])
    for c, s in itertools.product(COLOURS, SHAPES):
        add("colors", f"{_article(c)} {c} {s}", [_obj(s, c)])
    for (s1, s2), rel in itertools.product(itertools.permutations(SHAPES, 2), RELATIONS):
        add("position", f"a {s1} {RELATIONS[rel]} a {s2}", [_obj(s1), _obj(s2)], {"type": rel, "a": 0, "b": 1})
    for (s1, s2), (c1, c2) in itertools.product(itertools.permutations(SHAPES, 2),
                                                itertools.permutations(COLOURS, 2)):
        add("color_attr", f"{_article(c1)} {c1} {s1} and {_article(c2)} {c2} {s2}", [_obj(s1, c1), _obj(s2, c2)])
    return out


# Categories with at least this many prompts hold some out of training (val and test);
# smaller ones (single and two objects) are shared by every split, as their space is tiny.
HOLDOUT_MIN_PROMPTS = 18
TEST_FRACTION, VAL_FRACTION = 0.25, 0.10


def _stable_order(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def hash_split(groups: dict[str, list[dict]], shared_below: int = 0) -> dict[str, list[dict]]:
    """Fixed train / val / test lists of items with a `prompt`: each group's items ordered by a
    hash of the prompt, TEST_FRACTION of them to test and VAL_FRACTION to val (at least one each),
    the rest to train; a group with fewer than `shared_below` items goes whole to every split."""
    splits = {"train": [], "val": [], "test": []}
    for items in groups.values():
        if len(items) < shared_below:
            for name in splits:
                splits[name].extend(items)
            continue
        ordered = sorted(items, key=lambda it: _stable_order(it["prompt"]))
        n_test = max(1, round(len(ordered) * TEST_FRACTION))
        n_val = max(1, round(len(ordered) * VAL_FRACTION))
        splits["test"].extend(ordered[:n_test])
        splits["val"].extend(ordered[n_test:n_test + n_val])
        splits["train"].extend(ordered[n_test + n_val:])
    return splits


def prompt_splits() -> dict[str, list[dict]]:
    """Fixed train / val / test prompt lists (a deterministic hash split per category)."""
    return hash_split(all_prompts(), HOLDOUT_MIN_PROMPTS)


def cycled_items(items: list[dict], key: str, groups: tuple[str, ...], per_group: int, seed: int) -> list[dict]:
    """`per_group` items of each group (the items' `key`), cycling through that group's items,
    each with its own sampling seed: seed * 1e6 + group index * 1e4 + k."""
    by_group: dict[str, list[dict]] = {}
    for item in items:
        by_group.setdefault(item[key], []).append(item)
    out = []
    for g_index, group in enumerate(groups):
        for k in range(per_group):
            item = dict(by_group[group][k % len(by_group[group])])
            item["seed"] = seed * 1_000_000 + g_index * 10_000 + k
            out.append(item)
    return out


def evaluation_items(split: str = "test", per_category: int = 64, seed: int = 0) -> list[dict]:
    """(prompt, seed) items for evaluation: `per_category` per category, cycling through the
    split's prompts of that category, each with its own sampling seed."""
    return cycled_items(prompt_splits()[split], "category", CATEGORIES, per_category, seed)


# ---------------------------------------------------------------------------------- render
@dataclass
class Placed:
    shape: str
    colour: str
    x0: float
    y0: float
    size: float

    @property
    def cx(self) -> float:
        return self.x0 + self.size / 2

    @property
    def cy(self) -> float:
        return self.y0 + self.size / 2


def _expand(spec: dict, rng: random.Random) -> list[tuple[str, str, int]]:
    """(shape, colour, index of the spec object) for every object to draw."""
    objects = []
    for i, obj in enumerate(spec["objects"]):
        for _ in range(obj["count"]):
            objects.append((obj["shape"], obj.get("colour") or rng.choice(list(COLOURS)), i))
    return objects


def _overlaps(a: Placed, b: Placed, gap: float) -> bool:
    return not (a.x0 + a.size + gap <= b.x0 or b.x0 + b.size + gap <= a.x0 or
                a.y0 + a.size + gap <= b.y0 or b.y0 + b.size + gap <= a.y0)


def layout(spec: dict, seed: int, size: int = 32) -> list[Placed]:
    """Non-overlapping placements satisfying the spec (rejection sampling, deterministic)."""
    rng = random.Random(seed)
    objects = _expand(spec, rng)
    relation = spec.get("relation")
    gap, margin = size / 16, size * 0.2
    lo, hi = 0.25 * size, 0.38 * size  # object side length range
    if len(objects) >= 4:
        hi = 0.3 * size
    for _attempt in range(2000):
        placed: list[Placed] = []
        for shape, colour, _index in objects:
            side = rng.uniform(lo, hi)
            for _try in range(50):
                p = Placed(shape, colour, rng.uniform(1, size - side - 1), rng.uniform(1, size - side - 1), side)
                if not any(_overlaps(p, q, gap) for q in placed):
                    placed.append(p)
                    break
            else:
                break
        if len(placed) != len(objects):
            continue
        if relation and not relation_holds(relation["type"], placed[relation["a"]], placed[relation["b"]], margin):
            continue
        return placed
    raise RuntimeError(f"could not lay out {spec} (seed {seed})")


def draw(placed: list[Placed], size: int = 32) -> np.ndarray:
    big = size * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), (0, 0, 0))
    pen = ImageDraw.Draw(canvas)
    for p in placed:
        x0, y0, s = p.x0 * SUPERSAMPLE, p.y0 * SUPERSAMPLE, p.size * SUPERSAMPLE
        fill = COLOURS[p.colour]
        if p.shape == "circle":
            pen.ellipse([x0, y0, x0 + s, y0 + s], fill=fill)
        elif p.shape == "square":
            pen.rectangle([x0, y0, x0 + s, y0 + s], fill=fill)
        else:  # upward isosceles triangle filling its box
            pen.polygon([(x0 + s / 2, y0), (x0 + s, y0 + s), (x0, y0 + s)], fill=fill)
    return np.array(canvas.resize((size, size), Image.BOX), dtype=np.uint8)


def render(spec: dict, seed: int, size: int = 32) -> np.ndarray:
    """uint8 [size, size, 3] image of a scene satisfying `spec`; the same seed gives the same image."""
    return draw(layout(spec, seed, size), size)


def vocabulary() -> list[str]:
    """Every word a prompt can contain (for the word-level tokenizer)."""
    words = set()
    for items in all_prompts().values():
        for item in items:
            words.update(item["prompt"].split())
    return sorted(words)
