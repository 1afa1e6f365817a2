"""The shapes world's text task: a short word in quotes, drawn in capitals on the black canvas.

Flow-GRPO's visual-text task in miniature, for the `ocr` reward: the prompt is
`a sign that says "sun"`, the image shows SUN in one of the world's colours, centred, with a
little jitter in size and place. The words are three letters so that they stay legible at 32 px
(8-9 px capitals, which the OCR engine reads almost without error on clean renders). Text is drawn
at 4x in Pillow's built-in scalable font, emboldened, and box-filtered down, like the shapes.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pixelrl.shapes.world import SUPERSAMPLE
from pixelrl.shapes.detector import COLOURS

CATEGORY = "text"
# 24 three-letter words over 21 letters
WORDS = ("sun", "cat", "box", "red", "map", "fox", "jam", "owl", "zip", "key", "web", "hut",
         "dog", "pen", "cup", "sky", "bug", "ice", "van", "leg", "mud", "fig", "ray", "tub")
TEMPLATE = 'a sign that says "{word}"'
FONT_PX = (11.0, 12.5)  # font size range at 32 px, before supersampling
# Offset of the word's centre from the canvas centre, at most (x, y) pixels at 32 px. The layout
# stays nearly fixed on purpose: a small model first learns the mean image of a prompt, and over
# centred signs that mean is a legible (grey) word, whereas over signs anywhere on the canvas it is
# a dark smear; runs with the word placed anywhere drew no glyphs after 1,600 steps.
JITTER_PX = (1.0, 2.0)
# Strokes thickened by half a pixel (at 32 px): 1.7x the ink of the plain font, as legible to the
# OCR engine, and more of the image for the flow-matching loss to learn the glyphs from
STROKE = 0.5
TEST_SEEDS, VAL_SEEDS = 8, 4  # evaluation images per word (all words are in every split)


def prompt_items() -> list[dict]:
    """Every prompt of the task as {prompt, category, metadata}; `metadata["text"]` is the word."""
    return [{"prompt": TEMPLATE.format(word=w), "category": CATEGORY, "metadata": {"category": CATEGORY, "text": w}}
            for w in WORDS]


def evaluation_items(split: str = "test", per_word: int | None = None, seed: int = 0) -> list[dict]:
    """(prompt, seed) items: `per_word` seeds per word (8 for test, 4 for val by default). A
    word-level text encoder cannot spell an unseen word, so the splits differ by seed, not word."""
    if split not in ("val", "test"):
        raise ValueError(f"split {split!r}: val or test")
    per_word = per_word or (TEST_SEEDS if split == "test" else VAL_SEEDS)
    offset = 0 if split == "test" else 500_000
    items = []
    for w_index, item in enumerate(prompt_items()):
        for k in range(per_word):
            items.append({**item, "seed": seed * 1_000_000 + offset + w_index * 1_000 + k})
    return items


def _font(px: float) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px * SUPERSAMPLE)


def render(word: str, seed: int, size: int = 32) -> np.ndarray:
    """uint8 [size, size, 3]: `word` in capitals, a random colour, centred with a little jitter
    in size and place (whole word inside the canvas with a one-pixel margin); the same seed gives
    the same image."""
    rng = random.Random(f"{word}:{seed}")
    big = size * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), (0, 0, 0))
    pen = ImageDraw.Draw(canvas)
    text = word.upper()
    px = rng.uniform(*FONT_PX) * size / 32
    stroke = round(STROKE * SUPERSAMPLE * size / 32)
    margin = SUPERSAMPLE
    while True:  # a wide word at a large size is set smaller until it fits
        font = _font(px)
        left, top, right, bottom = pen.textbbox((0, 0), text, font=font, stroke_width=stroke)
        width, height = right - left, bottom - top
        if width + 2 * margin <= big:
            break
        px *= 0.95
    jitter_x, jitter_y = (j * SUPERSAMPLE * size / 32 for j in JITTER_PX)
    # the jitter shrinks where the word is too wide for it, so the margin always holds
    slack_x = min(jitter_x, (big - width) / 2 - margin)
    x = (big - width) / 2 + rng.uniform(-slack_x, slack_x) - left
    y = (big - height) / 2 + rng.uniform(-jitter_y, jitter_y) - top
    colour = COLOURS[rng.choice(list(COLOURS))]
    pen.text((x, y), text, fill=colour, font=font, stroke_width=stroke, stroke_fill=colour)
    return np.array(canvas.resize((size, size), Image.BOX), dtype=np.uint8)


def vocabulary() -> list[str]:
    """Every token a prompt can contain (for the word-level tokenizer): the template's words,
    the quote mark (CLIP's pre-tokenizer splits it off) and the words."""
    return sorted(set(TEMPLATE.replace('"{word}"', "").split()) | {'"'} | set(WORDS))
