"""Demonstrations of the shapes world for supervised fine-tuning: each prompt's exact scene,
rendered by the world's own renderer (`world.render`) from the prompt row's metadata, in several
layouts (seeds); `pixelrl make-demonstrations OUT` writes them."""

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
