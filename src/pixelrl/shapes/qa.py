"""Shapes-QA: questions about rendered shapes scenes, the default task for vision-language RL.

Each item is a scene of one to four objects (the shapes world's renderer) and one question of
three types, answered by one word:

- `count`: "how many red circles are there ?" -> zero / one / two / three / four
- `colour`: "what colour is the square ?" (a shape drawn once) -> a colour name
- `position`: "is the triangle left of the circle ?" (two shapes drawn once) -> yes / no

Answers are computed from the placements, never from a detector, so they are exact. Position
questions are only asked when the centres are at least `POSITION_MARGIN` of the image apart
along the asked axis. Items are a pure function of (split, index): train and held-out scenes
come from disjoint seed ranges.
"""

from __future__ import annotations

import random

import numpy as np

from pixelrl.shapes.world import Placed, draw, layout
from pixelrl.shapes.detector import COLOURS, SHAPES
from pixelrl.vlm.qa_tasks import QA_TASKS, QATask

QUESTION_TYPES = ("count", "colour", "position")
COUNT_WORDS = ("zero", "one", "two", "three", "four")
RELATION_WORDS = {"left_of": "left of", "right_of": "right of", "above": "above", "below": "below"}
POSITION_MARGIN = 0.12  # fraction of the image side
IMAGE_SIZE = 32
SPLIT_SEED_BASE = {"train": 0, "val": 10**9, "test": 2 * 10**9}


def answers() -> list[str]:
    """Every answer the task can have."""
    return list(COUNT_WORDS) + list(COLOURS) + ["yes", "no"]


def vocabulary() -> list[str]:
    """Every word a question or an answer can contain (for the word-level tokenizer)."""
    words = {"how", "many", "are", "there", "?", "what", "colour", "is", "the"}
    words.update(SHAPES)
    words.update(s + "s" for s in SHAPES)
    words.update(w for phrase in RELATION_WORDS.values() for w in phrase.split())
    words.update(answers())
    return sorted(words)


def _relation_true(kind: str, a: Placed, b: Placed) -> bool:
    return {"left_of": a.cx < b.cx, "right_of": a.cx > b.cx, "above": a.cy < b.cy, "below": a.cy > b.cy}[kind]


def _axis_gap(kind: str, a: Placed, b: Placed) -> float:
    return abs(a.cx - b.cx) if kind in ("left_of", "right_of") else abs(a.cy - b.cy)


def _scene(qtype: str, rng: random.Random) -> list[tuple[str, str]]:
    """The objects of a scene. Count scenes hold k = 0..4 copies of a target (uniform, so every
    answer is equally common) plus near-miss distractors (same shape or same colour)."""
    if qtype != "count":
        return [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(rng.randint(1, 4))]
    target = (rng.choice(SHAPES), rng.choice(list(COLOURS)))
    k = rng.randint(0, 4)
    objects = [target] * k
    for _ in range(rng.randint(1 if k == 0 else 0, 4 - k)):
        if rng.random() < 0.5:
            objects.append((target[0], rng.choice([c for c in COLOURS if c != target[1]])))
        else:
            objects.append((rng.choice([s for s in SHAPES if s != target[0]]), target[1]))
    rng.shuffle(objects)
    return [target] + objects  # the target leads; it is dropped again before layout


def _question(qtype: str, objects: list[tuple[str, str]], placed: list[Placed], rng: random.Random):
    """(question, answer) or None when the scene cannot carry this question type."""
    shape_counts = {s: sum(1 for o in objects if o[0] == s) for s in SHAPES}
    unique = [s for s in SHAPES if shape_counts[s] == 1]
    if qtype == "count":
        raise AssertionError("count questions are built with their scene")
    if qtype == "colour":
        if not unique:
            return None
        shape = rng.choice(unique)
        return f"what colour is the {shape} ?", next(c for s, c in objects if s == shape)
    if len(unique) < 2:
        return None
    s1, s2 = rng.sample(unique, 2)
    a, b = (placed[next(i for i, o in enumerate(objects) if o[0] == s)] for s in (s1, s2))
    kinds = [k for k in RELATION_WORDS if _axis_gap(k, a, b) >= POSITION_MARGIN * IMAGE_SIZE]
    if not kinds:
        return None
    kind = rng.choice(kinds)
    return f"is the {s1} {RELATION_WORDS[kind]} the {s2} ?", "yes" if _relation_true(kind, a, b) else "no"


def item(split: str, index: int) -> dict:
    """Item `index` of `split`: {question, answer, type, seed, image (uint8 [32, 32, 3])}.

    The question type cycles with the index (so every block of three holds one of each); the
    scene is redrawn until it can carry that type.
    """
    if split not in SPLIT_SEED_BASE:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEED_BASE)}, got {split!r}")
    qtype = QUESTION_TYPES[index % len(QUESTION_TYPES)]
    seed = SPLIT_SEED_BASE[split] + index
    rng = random.Random(seed)
    while True:
        objects = _scene(qtype, rng)
        if qtype == "count":
            (shape, colour), objects = objects[0], objects[1:]
        spec = {"objects": [{"shape": s, "colour": c, "count": 1} for s, c in objects]}
        placed = layout(spec, rng.randrange(2**31), IMAGE_SIZE)
        if qtype == "count":
            n = sum(1 for o in objects if o == (shape, colour))
            qa = f"how many {colour} {shape}s are there ?", COUNT_WORDS[n]
        else:
            qa = _question(qtype, objects, placed, rng)
        if qa is not None:
            break
    question, answer = qa
    return {"question": question, "answer": answer, "type": qtype, "seed": seed,
            "objects": [list(o) for o in objects], "image": np.ascontiguousarray(draw(placed, IMAGE_SIZE))}


def items(split: str, start: int, count: int) -> list[dict]:
    return [item(split, i) for i in range(start, start + count)]


def colour_only_accuracy(it: dict) -> float:
    """Expected accuracy on `it` of a reference policy that sees each object's colour but neither
    its shape nor its place: a colour question names one object, equally likely any of them, so it
    answers the colour of a random object; a count question it answers with the number of objects of
    the asked colour; a yes/no position question it answers at random.

    A model that scores no better than this on a question type has learned colours, not shapes:
    it is the ceiling of what colour perception alone gives."""
    colours = [c for _, c in it["objects"]]
    if it["type"] == "colour":
        return colours.count(it["answer"]) / len(colours)
    if it["type"] == "count":
        asked = it["question"].split()[2]  # "how many <colour> <shape>s are there ?"
        return float(COUNT_WORDS[min(colours.count(asked), len(COUNT_WORDS) - 1)] == it["answer"])
    return 0.5



QA_TASKS.register("shapes_qa")(QATask(items=items, question_types=QUESTION_TYPES))
