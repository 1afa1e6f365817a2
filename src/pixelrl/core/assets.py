"""Paths of what ships inside the package: `builtin:<name>` in a config resolves here."""

from __future__ import annotations

from pathlib import Path

from pixelrl.core.errors import ConfigError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUILTIN = {
    "shapes": ASSETS / "shapes_sd3",  # the project-trained shapes model (pipeline folder)
    "shapes/train": ASSETS / "shapes_prompts" / "train.jsonl",
    # 64 rows per category (small categories cycle), so RL batches are not mostly color_attr
    "shapes/train_balanced": ASSETS / "shapes_prompts" / "train_balanced.jsonl",
    "shapes/val": ASSETS / "shapes_prompts" / "val.jsonl",
    "shapes/test": ASSETS / "shapes_prompts" / "test.jsonl",
    # the text task's 24 prompts (a sign that says "sun"); train and validation differ by seed
    "shapes_text": ASSETS / "shapes_text_sd3",  # the project-trained text-world model (pipeline folder)
    "shapes_text/words": ASSETS / "shapes_text_prompts" / "words.jsonl",
    # the project-trained shapes editing model (FLUX.1 Kontext layout) and the editing world's
    # (instruction, source image) rows
    "shapes_edit": ASSETS / "shapes_edit_kontext",
    "shapes_edit/train": ASSETS / "shapes_edit_prompts" / "train.jsonl",
    "shapes_edit/val": ASSETS / "shapes_edit_prompts" / "val.jsonl",
    "shapes_qa_vlm": ASSETS / "shapes_qa_vlm",  # the project-trained shapes-QA Qwen2-VL (model folder)
}
PREFIX = "builtin:"
# names of models no longer shipped: a config that still names one gets the replacement
RETIRED = {"shapes_v2": "shapes", "shapes_v3": "shapes"}


def resolve(path: str, field: str = "model.path") -> str:
    """`builtin:shapes` -> the packaged folder; any other path is returned unchanged."""
    if not isinstance(path, str) or not path.startswith(PREFIX):
        return path
    name = path[len(PREFIX):]
    if name in RETIRED:
        raise ConfigError(field, path, f"{path} is no longer shipped: use {PREFIX}{RETIRED[name]} (the former "
                          "builtin:shapes_v3, the one shapes model since 2026-11-27; docs/history/shapes_log.md keeps the "
                          "older models' results as history)")
    if name not in BUILTIN:
        raise ConfigError(field, path, f"unknown built-in; choose one of {[PREFIX + k for k in BUILTIN]}")
    target = BUILTIN[name]
    if not target.exists():
        raise ConfigError(field, path, f"the package has no {target}: reinstall pixelrl from a full checkout")
    return str(target)
