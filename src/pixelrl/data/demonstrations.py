"""Demonstrations for supervised fine-tuning: (prompt, target image) rows, and for an edit family
(instruction, source image(s), target image) rows.

A `.jsonl` or `.parquet` file; each row has the prompt (`data.prompt_key`), `target` (the image
the model should draw for it: a path relative to the file's folder or absolute, raw bytes, or
`{"bytes": ...}` / `{"path": ...}` as a Hugging Face image column exports it), for an edit family
its source as a prompt row names it (`image`, or `images` for several: paths relative to the
file), and optionally `data_source` and `metadata` (handed to the validation rewards). Every
target and source is decoded in full when the file is read, and a target must be
rollout.resolution square; both are decoded again when their row is drawn, the sources fitted to
the run's condition size as a prompt row's are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pixelrl.data.preferences import ImageRowsDataset, read_image_rows
from pixelrl.data.prompts import collate_rows

TARGET_KEY = "target"


def read_demonstration_file(path: str | Path, resolution: int, prompt_key: str = "prompt") -> list[dict]:
    """Checked rows: {prompt, data_source, metadata, file, row, target (path or bytes)[, images]}."""
    return [row for row, _ in read_image_rows(path, resolution, prompt_key, (TARGET_KEY,), "demonstration",
                                              "write the shapes world's with `pixelrl make-demonstrations`")]


class DemonstrationDataset(ImageRowsDataset):
    """Demonstration rows (an edit's with its sources)."""

    keys = (TARGET_KEY,)
    read_file = staticmethod(read_demonstration_file)

    @staticmethod
    def collate(rows: list[dict]) -> dict:
        batch = collate_rows(rows)
        batch["targets"] = torch.from_numpy(np.stack([r[TARGET_KEY] for r in rows]))
        return batch
