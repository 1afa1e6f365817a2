"""Offline preference datasets for Diffusion-DPO: (prompt, chosen image, rejected image) rows.

A `.jsonl` or `.parquet` file; each row has the prompt (`data.prompt_key`), `chosen` and
`rejected`, and optionally `chosen_score`, `rejected_score`, `data_source` and `metadata`. An
image is a path (relative to the dataset file's folder, or absolute), raw bytes (a parquet
binary column), `{"bytes": ...}` (base64 text in jsonl) or `{"path": ...}`, the layout of an
exported Hugging Face image column. Every row is checked when the dataset is opened (the file
exists and decodes in full to an image of the training size, chosen and rejected of one size,
upright as its EXIF orientation says); the pixels are decoded again when a row is loaded.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from pixelrl.data.prompts import DatasetError, PromptDataset, _normalise, _row_error, read_records

IMAGE_KEYS = ("chosen", "rejected")


def _image_source(record: dict, key: str, folder: Path, path: Path, row: int):
    """A path or bytes for `record[key]`, or a DatasetError naming the file and row."""
    value = record.get(key)
    if isinstance(value, dict):
        if value.get("bytes"):
            value = value["bytes"]
            value = base64.b64decode(value) if isinstance(value, str) else value
        else:
            value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        image_path = Path(value) if Path(value).is_absolute() else folder / value
        if not image_path.is_file():
            raise _row_error(path, row, f"`{key}` image {image_path} does not exist")
        return image_path
    raise _row_error(path, row, f"`{key}` must be an image path or image bytes, got {type(value).__name__}")


def decode_image_source(source, path: Path, row: int, key: str) -> np.ndarray:
    """The image as uint8 [H, W, 3], upright as its EXIF orientation says, or the row's error:
    damaged pixel data shows only when it is decoded, so the check when the file is read decodes."""
    where = source if isinstance(source, Path) else "its bytes"
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as opened:
            return np.asarray(ImageOps.exif_transpose(opened).convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise _row_error(path, row, f"`{key}` image {where} is not a readable image ({err})") from None


def read_preference_file(path: str | Path, resolution: int, prompt_key: str = "prompt") -> list[dict]:
    """Checked rows: {prompt, data_source, metadata, chosen, rejected (path or bytes), scores}."""
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), "data.train_files"))
    if not path.is_file():
        raise DatasetError(f"preference file `{path}` does not exist: check data.train_files (write one with "
                           "`pixelrl make-preferences`)")
    rows = []
    for number, record in read_records(path, prompt_key, kinds=".jsonl or .parquet"):
        row = {**_normalise(path, number, record, prompt_key), "file": str(path), "row": number}
        sizes = []
        for key in IMAGE_KEYS:
            row[key] = _image_source(record, key, path.parent, path, number)
            height, width, _ = decode_image_source(row[key], path, number, key).shape
            sizes.append((width, height))
        if sizes[0] != sizes[1]:
            raise _row_error(path, number, f"chosen is {sizes[0][0]}x{sizes[0][1]} but rejected is "
                                           f"{sizes[1][0]}x{sizes[1][1]}: a pair must have one size")
        if sizes[0] != (resolution, resolution):
            raise _row_error(path, number, f"images are {sizes[0][0]}x{sizes[0][1]}, the model trains at "
                                           f"rollout.resolution = {resolution}: resize the dataset or set it")
        for key in ("chosen_score", "rejected_score"):
            if record.get(key) is not None:
                try:
                    row[key] = float(record[key])
                except (TypeError, ValueError):
                    raise _row_error(path, number, f"`{key}` must be a number, got {record[key]!r}") from None
        rows.append(row)
    if not rows:
        raise DatasetError(f"preference file `{path}` has no rows")
    return rows


class PreferenceDataset(PromptDataset):
    """Prompt rows with a pair of images each, decoded on access (uint8 [H, W, 3])."""

    @classmethod
    def from_files(cls, files, resolution: int, prompt_key: str = "prompt") -> "PreferenceDataset":
        return cls([row for f in files for row in read_preference_file(f, resolution, prompt_key)])

    def __getitem__(self, index: int) -> dict:
        row = dict(self.rows[index])
        for key in IMAGE_KEYS:
            row[key] = decode_image_source(row[key], Path(row["file"]), row["row"], key)
        return row


def collate_preferences(rows: list[dict]) -> dict:
    return {"prompts": [r["prompt"] for r in rows], "data_sources": [r["data_source"] for r in rows],
            "metadata": [r["metadata"] for r in rows],
            "chosen": torch.from_numpy(np.stack([r["chosen"] for r in rows])),
            "rejected": torch.from_numpy(np.stack([r["rejected"] for r in rows])),
            "scores": {key: [r.get(key) for r in rows] for key in ("chosen_score", "rejected_score")}}
