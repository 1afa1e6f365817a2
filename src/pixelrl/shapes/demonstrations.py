"""Demonstrations of the shapes worlds for supervised fine-tuning: each prompt's exact scene,
rendered by the world's own renderer (`world.render`) from the prompt row's metadata, in several
layouts (seeds); and the editing world's (instruction, source, a correct edit) triples
(`edit_world.edit_triple`). `pixelrl make-demonstrations OUT [--world edit]` writes them."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from pixelrl.shapes.world import render


def write_demonstrations(rows: list[dict], out: Path, *, per_prompt: int, seed: int, size: int = 32) -> Path:
    """`out/demonstrations.jsonl` and `out/images/*.png`: `per_prompt` renders of each row's scene
    (seeds seed, seed + 1, ... per row, distinct across rows), each row {prompt, target,
    data_source, metadata}. Rows without scene metadata are refused by the world's renderer."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / "demonstrations.jsonl"
    with path.open("w") as handle:
        for i, row in enumerate(rows):
            for k in range(per_prompt):
                name = f"images/{i * per_prompt + k:06d}.png"
                Image.fromarray(render(row["metadata"], seed + i * per_prompt + k, size)).save(out / name)
                handle.write(json.dumps({"prompt": row["prompt"], "target": name, "data_source": row["data_source"],
                                         "metadata": row["metadata"]}) + "\n")
    return path


def write_edit_demonstrations(out: Path, *, split: str = "train", per_edit: int, seed: int) -> Path:
    """`out/demonstrations.jsonl` and `out/images/*.png`: `per_edit` items of each kind of edit of
    `split`'s instructions (the (instruction, seed) items the editing world's rows and evaluations
    draw, from `seed`), each row {prompt, image (the source), target (a correct edit of it),
    data_source (the kind of edit), metadata (what the `shapes_edit` reward checks)}."""
    from pixelrl.shapes import edit_world

    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / "demonstrations.jsonl"
    with path.open("w") as handle:
        for n, item in enumerate(edit_world.evaluation_items(split, per_edit=per_edit, seed=seed)):
            source, target, metadata = edit_world.edit_triple(item, item["seed"])
            names = {key: f"images/{n:06d}_{key}.png" for key in ("source", "target")}
            Image.fromarray(source).save(out / names["source"])
            Image.fromarray(target).save(out / names["target"])
            handle.write(json.dumps({"prompt": item["prompt"], "image": names["source"], "target": names["target"],
                                     "data_source": item["edit"], "metadata": metadata}) + "\n")
    return path
