"""Question-answering datasets from files: the vision-language trainer's own data (`vlm.task: files`).

A `.jsonl` or `.parquet` file; each row has the question (the column `data.prompt_key`), `answer`
(the text the `answer_match` reward compares with) and `image`, and optionally `type` (validation
reports accuracy per type; without it, per `data_source`, which defaults to the file's name) and
`metadata` (a dict handed to reward functions beside the row's fields). An image is a path
(relative to the dataset file's folder, or absolute), raw bytes (a parquet binary column),
`{"bytes": ...}` (base64 text in jsonl) or `{"path": ...}`, the layout of an exported Hugging Face
image column. Every row is checked when the dataset is opened (a question, an answer, an image that
exists and opens); the pixels are decoded when an item is drawn, and an image that turns out
unreadable then names its file and row. Any size: the model's image processor resizes.

Items are a pure function of (split, index), as for the built-in shapes-QA task: training walks
the train files in an order shuffled afresh every epoch from `data.seed`, so a resumed run draws the
same questions as an uninterrupted one; validation takes the first `vlm.val_items` rows of the
validation files.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np

from pixelrl.data.preferences import _image_source, decode_image_source
from pixelrl.data.prompts import DatasetError, _normalise, _row_error, read_records, text_lines


def read_qa_file(path: str | Path, question_key: str = "prompt", field: str = "data.train_files") -> list[dict]:
    """Checked rows of one file: {question, answer, type, metadata, image (path or bytes), file, row}."""
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), field))
    if not path.is_file():
        raise DatasetError(f"question file `{path}` does not exist: check {field}")
    rows = []
    for number, record in read_records(path, question_key, kinds=".jsonl or .parquet"):
        base = _normalise(path, number, record, question_key)
        answer = record.get("answer")
        if answer is None or isinstance(answer, (dict, list)) or not str(answer).strip():
            raise _row_error(path, number, f"`answer` must be a non-empty string or number, got {answer!r}")
        image = _image_source(record, "image", path.parent, path, number)
        decode_image_source(image, path, number, "image")  # decoded in full: damaged data stops here, not mid-run
        kind = record.get("type")
        rows.append({"question": base["prompt"], "answer": str(answer).strip(),
                     "type": str(kind) if kind not in (None, "") else base["data_source"],
                     "metadata": base["metadata"], "image": image, "file": str(path), "row": number})
    if not rows:
        raise DatasetError(f"question file `{path}` has no rows")
    return rows


def read_text_file(path: str | Path, field: str) -> list[dict] | None:
    """Rows of plain pretraining text ({text, file, row}): a .txt file (one document per non-empty
    line), or .jsonl / .parquet rows with a non-empty `text` and no `image`; None for a file of
    (image, question, answer) rows."""
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), field))
    if not path.is_file():
        raise DatasetError(f"file `{path}` does not exist: check {field}")
    if path.suffix.lower() == ".txt":
        rows = [{"text": line.strip(), "file": str(path), "row": number}
                for number, line in text_lines(path) if line.strip()]
    else:
        records = read_records(path, "text", kinds=".jsonl, .parquet or .txt")
        first = next(records, None)
        if first is None or "text" not in first[1] or "image" in first[1]:
            return None
        rows = []
        for number, record in [first, *records]:
            text = record.get("text")
            if not isinstance(text, str) or not text.strip():
                raise _row_error(path, number, f"`text` must be a non-empty string (a plain-text file's rows), "
                                 f"got {text!r}")
            rows.append({"text": text, "file": str(path), "row": number})
    if not rows:
        raise DatasetError(f"file `{path}` has no rows: check {field}")
    return rows


@functools.lru_cache(maxsize=4)
def open_ptx_files(files: tuple[str, ...], question_key: str) -> tuple[dict, ...]:
    """vlm.ptx_files' rows, checked once per process: all plain text (LightRFT's pretrain mode:
    every token is a target) or all (image, question, answer) rows (the answer is the target)."""
    field = "vlm.ptx_files"
    texts = [read_text_file(f, field) for f in files]
    if all(rows is not None for rows in texts):
        return tuple(row for rows in texts for row in rows)
    if any(rows is not None for rows in texts):
        kinds = {str(f): "plain text" if rows is not None else "questions" for f, rows in zip(files, texts)}
        raise DatasetError(f"{field} mixes plain text and (image, question, answer) files {kinds}: a ptx set is one "
                           "kind (train the other in a separate run, or convert it)")
    return open_qa_files(files, question_key, field)


@functools.lru_cache(maxsize=4)
def open_qa_files(files: tuple[str, ...], question_key: str, field: str) -> tuple[dict, ...]:
    """The rows of every file, checked once per process (each worker draws its own items)."""
    if not files:
        raise DatasetError(f"{field} is empty: vlm.task=files reads its questions from {field} "
                           "(.jsonl or .parquet rows with a question, `answer` and `image`)")
    return tuple(row for f in files for row in read_qa_file(f, question_key, field))


def load_item(row: dict) -> dict:
    """The item the trainer uses: the row with its image decoded (uint8 [H, W, 3]) and its
    metadata's keys beside the row's own (which win on a clash)."""
    path = Path(row["file"])
    pixels = decode_image_source(row["image"], path, row["row"], "image")
    item = {**row["metadata"], **{k: v for k, v in row.items() if k != "metadata"}}
    item["image"] = pixels
    return item


def train_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of the train rows in `epoch`: a permutation drawn from (seed, epoch), or as written."""
    order = list(range(size))
    if shuffle:
        random.Random(f"pixelrl-qa-order/{seed}/{epoch}").shuffle(order)
    return order


def train_items(rows: tuple[dict, ...], start: int, count: int, seed: int, shuffle: bool) -> list[dict]:
    """Items `start .. start + count - 1` of the endless stream of epochs over `rows`."""
    out, orders = [], {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, len(rows))
        if epoch not in orders:
            orders[epoch] = train_order(len(rows), epoch, seed, shuffle)
        out.append(load_item(rows[orders[epoch][offset]]))
    return out


def write_qa_file(items: list[dict], path: str | Path, question_key: str = "prompt") -> Path:
    """Write items ({question, answer, type, image uint8 [H, W, 3]}) as a .jsonl file with one PNG per
    row in `<name>_images/` beside it: the layout `vlm.task: files` reads. Returns the file's path."""
    from PIL import Image

    path = Path(path)
    folder = path.parent / f"{path.stem}_images"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, it in enumerate(items):
        name = f"{index:06d}.png"
        Image.fromarray(np.asarray(it["image"], dtype=np.uint8)).save(folder / name)
        lines.append(json.dumps({question_key: it["question"], "answer": it["answer"], "type": it["type"],
                                 "image": f"{folder.name}/{name}"}))
    path.write_text("".join(line + "\n" for line in lines))
    return path
