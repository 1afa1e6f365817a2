"""A second, stricter judgement of a shapes image, for evaluation only: nothing trains on it.

The training reward's detector (`detector.py`) is lenient where leniency keeps a reward
informative: any hue is given its nearest palette colour, a component that overlaps its ideal shape
by 60% counts as that shape, specks under 6 pixels and grey or white pixels are ignored, and a shape
cut by the image border counts whole. A policy trained on it can drift toward images that pass it
and that a careful person would reject. This judge asks what that person would before calling a
scene right, and a scene passes only if all of these hold:

- every object is a clean shape: soft IoU with its ideal shape at least CAREFUL_IOU (chosen by
  eye on the demo's images: below it nearly every object is a smear, a blob or a blend; above it
  blunt but clear shapes, which a 32-pixel image draws);
- in a palette colour: its pixels' median hue within HUE_TOLERANCE of the palette hue;
- whole: no pixel in the image's outermost rows or columns (the renderer keeps every object a
  pixel inside; a generated shape touching the border is cut off);
- on its own: not touching an object of another colour (the renderer keeps objects apart; two
  colours touching is one object in two colours, or two merged);
- nothing else: at most STRAY_PIXELS bright pixels (any colour, grey and white too) outside the
  objects and their one-pixel anti-aliased rims: specks, grain, fragments, smudges;
- and the lenient detector's exact-scene verdict on the accepted objects (right counts, colours and
  relation, no unrequested object), where an object failing any check above is an unrequested
  blob.

On clean renders of the world it passes every scene (`tests/test_shapes_world.py`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from scipy import ndimage

from pixelrl.shapes.detector import FOREGROUND_VALUE, Detection, detect, score_detections

CAREFUL_IOU = 0.68
HUE_TOLERANCE = 15 / 360  # the palette's neighbouring hues are at least 45 degrees apart
STRAY_PIXELS = 4  # at 32 px; scaled with the image's area
REASONS = ("clean", "stray pixels", "cut at the border", "two colours touching", "off-palette colour", "misshapen",
           "unrequested object", "scene")


def _flaw(d: Detection, others: list[Detection]) -> str:
    if d.touches_border:
        return "cut at the border"
    rim = ndimage.binary_dilation(d.member, structure=np.ones((3, 3)))
    if any((rim & o.member).any() for o in others if o is not d):
        return "two colours touching"
    if d.hue_error > HUE_TOLERANCE:
        return "off-palette colour"
    if d.shape == "unknown" or d.iou < CAREFUL_IOU:
        return "misshapen"
    return ""


def careful_verdict(image: np.ndarray, spec: dict, objects: list[Detection] | None = None,
                    judge=None) -> tuple[bool, str]:
    """(passes, the first reason it does not, one of REASONS) for one uint8 image [H, W, 3];
    `objects` are its detections when the caller has them already. `judge(objects, width)` is the
    lenient verdict on the accepted objects, a dict with `exact` and `strict` (all asked for is
    there, extras aside): the text-to-image world's `score_detections` against `spec` unless given
    (the editing world passes its own)."""
    size = image.shape[0]
    scale = (size / 32) ** 2
    objects = detect(image) if objects is None else objects
    covered = np.zeros(image.shape[:2], dtype=bool)
    for d in objects:
        covered |= d.member
    # an object's one-pixel rim is its anti-aliased edge, whatever its colour there
    covered = ndimage.binary_dilation(covered, structure=np.ones((3, 3)))
    bright = image.astype(np.float32).max(axis=-1) / 255.0 > FOREGROUND_VALUE
    if int((bright & ~covered).sum()) > STRAY_PIXELS * scale:
        return False, "stray pixels"
    flaws = [_flaw(d, objects) for d in objects]
    judged = [replace(d, shape="unknown") if flaw else d for d, flaw in zip(objects, flaws)]
    scene = (judge or (lambda found, width: score_detections(found, spec, width)))(judged, image.shape[1])
    if scene["exact"]:
        return True, "clean"
    # an object's flaw, else an object nobody asked for, else the scene itself (counts, colours, relation)
    return False, next((f for f in flaws if f), "unrequested object" if scene["strict"] else "scene")
