"""Offline preference datasets for Diffusion-DPO: (prompt, chosen image, rejected image) rows.

A `.jsonl` or `.parquet` file; each row has the prompt (`data.prompt_key`), `chosen` and
`rejected`, for an edit family its source as a prompt row names it (`image`, or `images` for
several: paths relative to the file; both images of the pair are edits of it), and optionally
`chosen_score`, `rejected_score`, `data_source` and `metadata`. An
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
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from pixelrl.data.prompts import (DatasetError, PromptDataset, _condition_paths, _normalise, _row_error,
                                  collate_rows, read_records)

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


def read_image_rows(path: str | Path, resolution: int, prompt_key: str, keys: tuple[str, ...], kind: str,
                    write_hint: str) -> list[tuple[dict, dict]]:
    """(checked row, its record) of a file whose rows each hold images under `keys`, all decoded
    in full, of one size, and at `resolution` x `resolution`: {prompt, data_source, metadata,
    file, row, <key>: path or bytes[, images: an edit row's source paths]}. `kind` and
    `write_hint` name the file in its errors."""
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), "data.train_files"))
    if not path.is_file():
        raise DatasetError(f"{kind} file `{path}` does not exist: check data.train_files ({write_hint})")
    rows = []
    for number, record in read_records(path, prompt_key, kinds=".jsonl or .parquet"):
        row = {**_normalise(path, number, record, prompt_key), "file": str(path), "row": number}
        sizes = []
        for key in keys:
            row[key] = _image_source(record, key, path.parent, path, number)
            height, width, _ = decode_image_source(row[key], path, number, key).shape
            sizes.append((width, height))
        if len(set(sizes)) > 1:
            raise _row_error(path, number, f"{keys[0]} is {sizes[0][0]}x{sizes[0][1]} but {keys[1]} is "
                                           f"{sizes[1][0]}x{sizes[1][1]}: a pair must have one size")
        if sizes[0] != (resolution, resolution):
            raise _row_error(path, number, f"images are {sizes[0][0]}x{sizes[0][1]}, the model trains at "
                                           f"rollout.resolution = {resolution}: resize the dataset or set it")
        sources = _condition_paths(path, number, record)  # an edit's, named as a prompt row names them
        if sources:
            row["images"] = sources
        rows.append((row, record))
    if not rows:
        raise DatasetError(f"{kind} file `{path}` has no rows")
    return rows


def read_preference_file(path: str | Path, resolution: int, prompt_key: str = "prompt") -> list[dict]:
    """Checked rows: {prompt, data_source, metadata, chosen, rejected (path or bytes), scores}."""
    rows = []
    for row, record in read_image_rows(path, resolution, prompt_key, IMAGE_KEYS, "preference",
                                       "write one with `pixelrl make-preferences`"):
        for key in ("chosen_score", "rejected_score"):
            if record.get(key) is not None:
                try:
                    row[key] = float(record[key])
                except (TypeError, ValueError):
                    raise _row_error(Path(row["file"]), row["row"], f"`{key}` must be a number, got "
                                                                   f"{record[key]!r}") from None
        rows.append(row)
    return rows


class ImageRowsDataset(PromptDataset):
    """Prompt rows with images under `keys`, decoded on access (uint8 [H, W, 3]); a row with
    sources also carries them decoded at `output_size` (the run's condition size), and rows are
    batched apart by their number of sources."""

    keys: tuple[str, ...] = ()
    read_file: Callable[..., list[dict]]  # (path, resolution, prompt_key) -> the file's checked rows

    @classmethod
    def from_files(cls, files, resolution: int, prompt_key: str = "prompt",
                   condition_size: tuple[int, int] | None = None, condition_fit: str = "crop") -> "ImageRowsDataset":
        return cls([row for f in files for row in cls.read_file(f, resolution, prompt_key)], condition_size,
                   condition_fit)

    def __getitem__(self, index: int) -> dict:
        row = dict(self.rows[index])
        for key in self.keys:
            row[key] = decode_image_source(row[key], Path(row["file"]), row["row"], key)
        return self.with_conditions(row, index)

    def loader_buckets(self) -> list | None:
        return self.condition_buckets()


class PreferenceDataset(ImageRowsDataset):
    """Prompt rows with a pair of images each (and an edit's sources)."""

    keys = IMAGE_KEYS
    read_file = staticmethod(read_preference_file)

    @staticmethod
    def collate(rows: list[dict]) -> dict:
        return collate_preferences(rows)


def collate_preferences(rows: list[dict]) -> dict:
    return {**collate_rows(rows),
            "chosen": torch.from_numpy(np.stack([r["chosen"] for r in rows])),
            "rejected": torch.from_numpy(np.stack([r["rejected"] for r in rows])),
            "scores": {key: [r.get(key) for r in rows] for key in ("chosen_score", "rejected_score")}}
