"""Demonstrations for supervised fine-tuning: (prompt, target image) rows.

A `.jsonl` or `.parquet` file; each row has the prompt (`data.prompt_key`), `target` (the image
the model should draw for it: a path relative to the file's folder or absolute, raw bytes, or
`{"bytes": ...}` / `{"path": ...}` as a Hugging Face image column exports it), and optionally
`data_source` and `metadata` (handed to the validation rewards). Every target is decoded in full
when the file is read and must be rollout.resolution square; it is decoded again when its row is
drawn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pixelrl.data.preferences import ImageRowsDataset, read_image_rows

TARGET_KEY = "target"


def read_demonstration_file(path: str | Path, resolution: int, prompt_key: str = "prompt") -> list[dict]:
    """Checked rows: {prompt, data_source, metadata, file, row, target (path or bytes)}."""
    return [row for row, _ in read_image_rows(path, resolution, prompt_key, (TARGET_KEY,), "demonstration",
                                              "write the shapes world's with `pixelrl make-demonstrations`")]


class DemonstrationDataset(ImageRowsDataset):
    keys = (TARGET_KEY,)

    @classmethod
    def from_files(cls, files, resolution: int, prompt_key: str = "prompt") -> "DemonstrationDataset":
        return cls([row for f in files for row in read_demonstration_file(f, resolution, prompt_key)])

    @staticmethod
    def collate(rows: list[dict]) -> dict:
        return {"prompts": [r["prompt"] for r in rows], "data_sources": [r["data_source"] for r in rows],
                "metadata": [r["metadata"] for r in rows],
                "targets": torch.from_numpy(np.stack([r[TARGET_KEY] for r in rows]))}
