"""The shapes-editing world: (source scene, instruction, target scene) triples.

Five kinds of edit on the text-to-image world's scenes (flat shapes in six colours on black):

- recolour: "make the red circle blue"   (the object stays where it is, in the new colour)
- remove:   "remove the red circle"
- add:      "add a blue square"          (anywhere free)
- move:     "move the red circle up"     (left, right, up or down; it keeps its other coordinate)
- count:    "make it three red circles"  (a scene of red circles only, copies added anywhere free
            or taken away, the rest kept in place)

Everything the instruction does not touch stays where it was. A triple is built from an
instruction and a seed, deterministically; the instructions are split into train, val and test by
a hash, as the text-to-image world's prompts are, so held-out instructions are never trained on.

A row's metadata says what a correct edit holds (`score_edit` checks an image against it):
`keep` objects must be found at their place (within POSITION_TOLERANCE pixels), `edited` ones by
their rule (`at`: at a place; `free`: anywhere; `left`/`right`/`up`/`down`: moved that way from
their source place by at least MOVE_MIN pixels, the other coordinate kept; `one_of`: at one of
several places, for copies a count edit keeps), `removed` ones must be gone from their place,
and nothing else may be in the image.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import torch

from pixelrl.rewards.registry import check_number_option, register_reward
from pixelrl.shapes.detector import COLOURS, NUMBERS, SHAPES, Detection, detect
from pixelrl.shapes.world import Placed, _article, _overlaps, cycled_items, draw, hash_split

EDITS = ("recolour", "remove", "add", "move", "count")
DIRECTIONS = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
POSITION_TOLERANCE = 3.0  # pixels at 32 px: an object found this close to its place has stayed
MOVE_MIN = 4.0  # pixels at 32 px an object must move in the instructed direction
SIZE = 32  # the scenes' side in pixels: sources, targets and the edits judged


def _name(shape: str, colour: str, count: int = 1) -> str:
    return f"{colour} {shape}" + ("s" if count > 1 else "")


def all_instructions() -> dict[str, list[dict]]:
    """Every instruction of every kind, each {prompt, edit, shape, colour, ...the edit's argument}."""
    out: dict[str, list[dict]] = {e: [] for e in EDITS}
    for shape, colour in itertools.product(SHAPES, COLOURS):
        thing = _name(shape, colour)
        for new in COLOURS:
            if new != colour:
                out["recolour"].append({"prompt": f"make the {thing} {new}", "edit": "recolour", "shape": shape,
                                        "colour": colour, "new_colour": new})
        out["remove"].append({"prompt": f"remove the {thing}", "edit": "remove", "shape": shape, "colour": colour})
        out["add"].append({"prompt": f"add {_article(colour)} {thing}", "edit": "add", "shape": shape,
                           "colour": colour})
        for direction, words in DIRECTIONS.items():
            out["move"].append({"prompt": f"move the {thing} {words}", "edit": "move", "shape": shape,
                                "colour": colour, "direction": direction})
        for count in NUMBERS:
            out["count"].append({"prompt": f"make it {NUMBERS[count]} {_name(shape, colour, count)}", "edit": "count",
                                 "shape": shape, "colour": colour, "count": count})
    return out


def instruction_splits() -> dict[str, list[dict]]:
    """Fixed train / val / test instruction lists: the text-to-image world's hash split, per kind
    of edit, every kind held out in part."""
    return hash_split(all_instructions())


def vocabulary() -> list[str]:
    """Every word an instruction can contain (for the edit model's word-level tokenizer)."""
    return sorted({word for items in all_instructions().values() for item in items for word in item["prompt"].split()})


# ---------------------------------------------------------------------------------- triples
def _side(rng: random.Random, size: int, crowded: bool) -> float:
    return rng.uniform(0.25 * size, (0.3 if crowded else 0.38) * size)


def _place(placed: list[Placed], shape: str, colour: str, rng: random.Random, size: int, crowded: bool,
           tries: int = 60) -> Placed | None:
    gap = size / 16
    for _ in range(tries):
        side = _side(rng, size, crowded)
        p = Placed(shape, colour, rng.uniform(1, size - side - 1), rng.uniform(1, size - side - 1), side)
        if not any(_overlaps(p, q, gap) for q in placed):
            return p
    return None


def _others(item: dict, rng: random.Random, how_many: int) -> list[tuple[str, str]]:
    """Distinct (shape, colour) pairs for the scene's other objects, none the instruction's own."""
    pairs = [(s, c) for s, c in itertools.product(SHAPES, COLOURS) if (s, c) != (item["shape"], item["colour"])]
    return rng.sample(pairs, how_many)


def _moved(p: Placed, direction: str, rng: random.Random, size: int) -> Placed:
    distance = rng.uniform(0.25 * size, 0.45 * size)
    dx, dy = {"left": (-distance, 0), "right": (distance, 0), "up": (0, -distance), "down": (0, distance)}[direction]
    return Placed(p.shape, p.colour, p.x0 + dx, p.y0 + dy, p.size)


def _inside(p: Placed, size: int) -> bool:
    return 1 <= p.x0 and 1 <= p.y0 and p.x0 + p.size <= size - 1 and p.y0 + p.size <= size - 1


def _entry(p: Placed, rule: str = "at", **extra) -> dict:
    return {"shape": p.shape, "colour": p.colour, "cx": round(p.cx, 3), "cy": round(p.cy, 3), "rule": rule, **extra}


def _attempt(item: dict, rng: random.Random, size: int):
    """One try at (source, target, metadata) for `item`, or None when the draw does not fit."""
    edit, shape, colour = item["edit"], item["shape"], item["colour"]
    if edit == "count":
        have = rng.choice([n for n in NUMBERS if n != item["count"]])
        crowded = max(have, item["count"]) >= 3
        source: list[Placed] = []
        for _ in range(have):
            p = _place(source, shape, colour, rng, size, crowded)
            if p is None:
                return None
            source.append(p)
        target, edited, removed = list(source), [], []
        if item["count"] > have:
            for _ in range(item["count"] - have):
                p = _place(target, shape, colour, rng, size, crowded)
                if p is None:
                    return None
                target.append(p)
                edited.append(_entry(p, "free"))
            keep = [_entry(p) for p in source]
        else:  # which copies go is the model's choice: each kept one must be at one of the places
            kept = rng.sample(source, item["count"])
            target = kept
            places = [[round(p.cx, 3), round(p.cy, 3)] for p in source]
            edited = [{"shape": shape, "colour": colour, "rule": "one_of", "places": places} for _ in kept]
            keep = []
        return source, target, {"keep": keep, "edited": edited, "removed": removed}
    others = rng.randint(0 if edit != "remove" else 1, 2)
    crowded = others >= 2
    source = []
    pairs = [(shape, colour)] * (edit != "add") + _others(item, rng, others)
    for s, c in pairs:
        p = _place(source, s, c, rng, size, crowded)
        if p is None:
            return None
        source.append(p)
    rest = source[1:] if edit != "add" else source
    keep = [_entry(p) for p in rest]
    if edit == "recolour":
        it = source[0]
        new = Placed(shape, item["new_colour"], it.x0, it.y0, it.size)
        return source, [new, *rest], {"keep": keep, "edited": [_entry(new)], "removed": []}
    if edit == "remove":
        return source, rest, {"keep": keep, "edited": [], "removed": [_entry(source[0])]}
    if edit == "add":
        new = _place(source, shape, colour, rng, size, crowded)
        if new is None:
            return None
        return source, [*source, new], {"keep": keep, "edited": [_entry(new, "free")], "removed": []}
    # move: a place in that direction, inside the image and clear of the others
    it = source[0]
    new = _moved(it, item["direction"], rng, size)
    if not _inside(new, size) or any(_overlaps(new, q, size / 16) for q in rest):
        return None
    return source, [new, *rest], {"keep": keep, "removed": [],
                                  "edited": [_entry(it, item["direction"])]}  # judged from its source place


def edit_triple(item: dict, seed: int, size: int = SIZE) -> tuple[np.ndarray, np.ndarray, dict]:
    """(source image, one correct target image, metadata) for an instruction and a seed: uint8
    [size, size, 3] renders; the metadata is what `score_edit` checks a result against."""
    rng = random.Random(f"{item['prompt']}|{seed}")
    for _ in range(2000):
        made = _attempt(item, rng, size)
        if made is not None:
            source, target, rules = made
            metadata = {"edit": item["edit"], "instruction": item["prompt"], **rules}
            return draw(source, size), draw(target, size), metadata
    raise RuntimeError(f"could not build an edit for {item['prompt']!r} (seed {seed})")


def evaluation_items(split: str = "test", per_edit: int = 64, seed: int = 0) -> list[dict]:
    """(instruction, seed) items: `per_edit` of each kind of edit, cycling through the split's
    instructions of that kind, each with its own seed (which draws its source scene)."""
    return cycled_items(instruction_splits()[split], "edit", EDITS, per_edit, seed)


# ---------------------------------------------------------------------------------- judging
def _near(d: Detection, x: float, y: float, tolerance: float) -> bool:
    return abs(d.cx - x) <= tolerance and abs(d.cy - y) <= tolerance


def _fits(d: Detection, rule: dict, scale: float) -> bool:
    if d.shape != rule["shape"] or d.colour != rule["colour"]:
        return False
    tolerance = POSITION_TOLERANCE * scale
    kind = rule["rule"]
    if kind == "free":
        return True
    if kind == "at":
        return _near(d, rule["cx"] * scale, rule["cy"] * scale, tolerance)
    if kind == "one_of":
        return any(_near(d, x * scale, y * scale, tolerance) for x, y in rule["places"])
    x, y, step = rule["cx"] * scale, rule["cy"] * scale, MOVE_MIN * scale
    return {"left": d.cx <= x - step and abs(d.cy - y) <= tolerance,
            "right": d.cx >= x + step and abs(d.cy - y) <= tolerance,
            "up": d.cy <= y - step and abs(d.cx - x) <= tolerance,
            "down": d.cy >= y + step and abs(d.cx - x) <= tolerance}[kind]


def score_detections(detections: list[Detection], metadata: dict, width: int) -> dict:
    """How an edit's result, as detected objects, meets its metadata:

    - `kept`: the share of the objects the instruction does not touch found at their place (1
      when there are none);
    - `followed`: every edited object found by its rule, every removed one gone from its place and,
      for a count brought down, no copy left over;
    - `extra_objects`: detections no rule claims;
    - `exact`: followed, everything kept, nothing extra (the edit succeeded);
    - `partial`: the training reward, checks passed / (checks + extra objects), where the checks
      are one per kept, edited and removed object.
    Placed rules (kept objects, then moved and `one_of` ones) claim detections before `free` ones,
    each detection claimed once."""
    scale = width / 32
    claimed: set[int] = set()

    def claim(rule: dict) -> bool:
        found = next((d for d in detections if id(d) not in claimed and _fits(d, rule, scale)), None)
        if found is not None:
            claimed.add(id(found))
        return found is not None

    kept = [claim(rule) for rule in metadata["keep"]]
    edited_rules = sorted(metadata["edited"], key=lambda rule: rule["rule"] == "free")
    edited = [claim(rule) for rule in edited_rules]
    gone = [not any(_fits(d, {**rule, "rule": "at"}, scale) for d in detections) for rule in metadata["removed"]]
    extra = len(detections) - len(claimed)
    checks = kept + edited + gone
    # a count brought down: a copy left over at one of the places means the count is wrong
    leftover = any(id(d) not in claimed and _fits(d, rule, scale) for d in detections for rule in edited_rules
                   if rule["rule"] == "one_of")
    followed = all(edited) and all(gone) and not leftover
    kept_share = float(np.mean(kept)) if kept else 1.0
    return {"kept": kept_share, "followed": followed, "extra_objects": extra,
            "exact": followed and all(kept) and extra == 0,
            "partial": sum(checks) / max(len(checks) + extra, 1)}


def score_edit(image: np.ndarray, metadata: dict) -> dict:
    """`score_detections` of one uint8 result image [H, W, 3]."""
    return score_detections(detect(image), metadata, image.shape[1])


@register_reward("shapes_edit")
def shapes_edit(exact_weight: float = 0.0):
    """Training reward of the editing world: (1 - e) x partial credit + e x the exact edit (1 when
    the instruction is followed, everything else kept in place and nothing added; `score_detections`).
    Also returns `edit_exact`, `edit_followed`, `edit_kept` and `edit_extra_objects` for logging.
    It judges from each row's metadata (what the source held and what the edit asks), not from
    the source image."""

    def reward(images, prompts, metadata):
        rows = []
        for array, meta in zip(images.detach().cpu().numpy(), metadata):
            if not meta or "keep" not in meta:
                raise ValueError("shapes_edit needs each row's edit metadata (keep, edited, removed), as the rows "
                                 "of builtin:shapes_edit/train carry it")
            rows.append(score_edit(array, meta))
        column = lambda key: torch.tensor([float(r[key]) for r in rows])  # noqa: E731
        return {"shapes_edit": (1 - exact_weight) * column("partial") + exact_weight * column("exact"),
                "edit_exact": column("exact"), "edit_followed": column("followed"), "edit_kept": column("kept"),
                "edit_extra_objects": column("extra_objects")}

    return reward


RULE_NEEDS = {"free": (), "at": ("cx", "cy"), "one_of": ("places",), "left": ("cx", "cy"), "right": ("cx", "cy"),
              "up": ("cx", "cy"), "down": ("cx", "cy")}  # what `_fits` reads of each kind of rule


def edit_metadata_problem(metadata: dict) -> str:
    """What a row's metadata lacks for shapes_edit to score its edit ("" when nothing): the lists
    `keep`, `edited` and `removed` of rules, each with its shape, colour, kind (`rule`) and what
    that kind reads (`_fits`: a place cx, cy; `places` for one_of; nothing for free)."""
    for key in ("keep", "edited", "removed"):
        rules = metadata.get(key)
        if not isinstance(rules, list):
            return f"no `{key}` list of rules"
        for rule in rules:
            if not isinstance(rule, dict) or rule.get("rule") not in RULE_NEEDS:
                return f"a `{key}` rule without a known `rule` ({sorted(RULE_NEEDS)}): {rule!r}"
            needs = ("shape", "colour", *RULE_NEEDS[rule["rule"]])
            if not set(needs) <= set(rule):
                return f"a `{key}` rule without {', '.join(needs)}: {rule!r}"
    return ""


shapes_edit.metadata_problem = edit_metadata_problem
shapes_edit.check_options = lambda options, field: check_number_option(
    options, field, "exact_weight", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]: the weight of the exact edit")


def write_rows(folder: Path, split: str, per_edit: int, seed: int = 0) -> Path:
    """`folder/<split>.jsonl`: `per_edit` rows of each kind of edit of `split`'s instructions, each
    {prompt, image, data_source, metadata} with its source rendered to `images/<split>/NNNN.png`
    (a path relative to the file, as rows name their images)."""
    from PIL import Image

    images = folder / "images" / split
    images.mkdir(parents=True, exist_ok=True)
    lines = []
    for n, item in enumerate(evaluation_items(split, per_edit=per_edit, seed=seed)):
        source, _, metadata = edit_triple(item, item["seed"])
        name = f"images/{split}/{n:04d}.png"
        Image.fromarray(source).save(folder / name, optimize=True)
        lines.append(json.dumps({"prompt": item["prompt"], "image": name, "data_source": item["edit"],
                                 "metadata": metadata}))
    out = folder / f"{split}.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out
