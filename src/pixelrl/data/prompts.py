"""Prompt datasets (jsonl, parquet, txt) and stateful loaders.

A row has a `prompt` (the column name is configurable), and optionally `data_source` (used to
group validation metrics), `metadata` (a dict handed to reward functions, e.g. the ground
truth of a compositional prompt) and, for an edit family, its condition: `image` (one path) or
`images` (a list), relative to the file's folder. Each image is checked when the file is read
(there, decodable, a colour mode pixelrl converts, within the size limits) and decoded, upright
as its EXIF orientation says, when its row is drawn. A bad row stops loading with the file and row number.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pixelrl.core.errors import PixelRLError


class DatasetError(PixelRLError, ValueError):
    pass


def _row_error(path: Path, row: int, problem: str) -> DatasetError:
    return DatasetError(f"{path}, row {row}: {problem}")


def _normalise(path: Path, row: int, record, prompt_key: str) -> dict:
    if not isinstance(record, dict):
        raise _row_error(path, row, f"expected an object with a `{prompt_key}` field, got {type(record).__name__}")
    prompt = record.get(prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
        raise _row_error(path, row, f"`{prompt_key}` must be a non-empty string, got {prompt!r}")
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as err:
            raise _row_error(path, row, f"`metadata` is a string but not JSON ({err.msg})") from None
    if not isinstance(metadata, dict):
        raise _row_error(path, row, f"`metadata` must be an object, got {type(metadata).__name__}")
    return {"prompt": prompt, "data_source": str(record.get("data_source") or path.stem), "metadata": metadata}


def _prompt_row(path: Path, row: int, record, prompt_key: str, check_images: bool = True) -> dict:
    """A prompt file's row: `_normalise`d, with its condition images when it names any."""
    normalised = _normalise(path, row, record, prompt_key)
    images = _condition_paths(path, row, record, check_images)
    if images:
        normalised["images"] = images
    return normalised


# Modes PIL converts to RGB without guessing (CMYK, 16-bit and float images need a colour
# decision pixelrl should not make for the user); sides and pixels a source may have.
CONDITION_MODES = ("RGB", "RGBA", "L", "LA", "P")
MIN_SIDE, MAX_SIDE, MAX_PIXELS = 8, 8192, 40_000_000


def _condition_paths(path: Path, row: int, record: dict, check: bool = True) -> tuple[str, ...]:
    """The row's condition images (`image` or `images`), each checked (opened) unless `check` is
    false, as absolute paths."""
    if "image" in record and "images" in record:
        raise _row_error(path, row, "has both `image` and `images`: give one (`images` for several)")
    given = record.get("images", record.get("image"))
    if given is None:
        return ()
    entries = [given] if "image" in record else given
    field = "image" if "image" in record else "images"
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) and e.strip() for e in entries):
        raise _row_error(path, row, f"`{field}` must be {'a path' if field == 'image' else 'a non-empty list of paths'}"
                                    f" (relative to {path.parent}), got {given!r}")
    images = [(path.parent / entry).expanduser() for entry in entries]
    return tuple(_check_condition_image(path, row, image) if check else str(image.resolve()) for image in images)


def _check_condition_image(path: Path, row: int, image: Path) -> str:
    problem = condition_image_problem(image, " (paths are relative to the file's folder)")
    if problem:
        raise _row_error(path, row, problem)
    return str(image.resolve())


def condition_image_problem(image: Path, where: str = "") -> str:
    """Why `image` cannot be a condition image ("" when it can): missing (`where` says how its
    path was read), unreadable, a colour mode pixelrl does not read, or a size outside the limits."""
    from PIL import Image, UnidentifiedImageError

    if not image.is_file():
        return f"condition image `{image}` does not exist{where}"
    try:
        with Image.open(image) as opened:
            mode, (width, height) = opened.mode, opened.size
            # decoded in full once: `verify()` walks a PNG's chunks without inflating them, so a
            # file whose chunks are whole but whose pixel data is damaged would pass it and then
            # stop the run at the step that draws its row, at every resume
            opened.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return f"condition image `{image}` is not a readable image ({err})"
    if mode not in CONDITION_MODES:
        return (f"condition image `{image}` has colour mode {mode}; pixelrl reads {', '.join(CONDITION_MODES)}: "
                "convert it to RGB")
    if min(width, height) < MIN_SIDE or max(width, height) > MAX_SIDE or width * height > MAX_PIXELS:
        return (f"condition image `{image}` is {width} x {height}; sides must be {MIN_SIDE} to {MAX_SIDE} px and "
                f"the image at most {MAX_PIXELS // 1_000_000} MP")
    return ""


CONDITION_FITS = ("crop", "pad", "stretch")


def load_condition_image(file: str, height: int, width: int, fit: str = "crop") -> torch.Tensor:
    """A condition image as uint8 [height, width, 3]: RGB (transparency on white), fitted to the
    output's shape and resized with Lanczos. `crop`: its largest centred crop of that aspect (a
    source of the output's aspect, as an edit's output follows it, loses nothing); `pad`: all of it,
    scaled to fit inside and centred on white (verl-omni's edit data, letterboxed to a square);
    `stretch`: all of it, resized to the output's shape (flow_grpo's edit scripts)."""
    from PIL import Image, ImageOps

    with Image.open(file) as opened:
        # shown as every viewer (and diffusers' `load_image`) shows it: EXIF orientation applied
        upright = ImageOps.exif_transpose(opened)
        image = upright.convert("RGBA") if upright.mode in ("RGBA", "LA", "P") else upright.convert("RGB")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image).convert("RGB")
    if fit not in CONDITION_FITS:
        raise ValueError(f"fit {fit!r}: choose one of {list(CONDITION_FITS)}")
    w, h = image.size
    if fit == "pad":
        scale = min(width / w, height / h)
        inner = (max(1, min(width, round(w * scale))), max(1, min(height, round(h * scale))))
        canvas = Image.new("RGB", (width, height), (255, 255, 255))
        canvas.paste(image.resize(inner, Image.LANCZOS) if inner != (w, h) else image,
                     ((width - inner[0]) // 2, (height - inner[1]) // 2))
        return torch.from_numpy(np.array(canvas, dtype=np.uint8))
    if fit == "stretch":
        return torch.from_numpy(np.array(image.resize((width, height), Image.LANCZOS), dtype=np.uint8))
    crop_w, crop_h = min(w, round(h * width / height)), min(h, round(w * height / width))
    left, top = (w - crop_w) // 2, (h - crop_h) // 2
    image = image.crop((left, top, left + crop_w, top + crop_h))
    if image.size != (width, height):
        image = image.resize((width, height), Image.LANCZOS)
    return torch.from_numpy(np.array(image, dtype=np.uint8))


# EXIF orientations that turn the picture a quarter (transposed, rotated 90 or 270, transversed)
QUARTER_TURNS = (5, 6, 7, 8)


def image_size(file: str) -> tuple[int, int]:
    """(width, height) of an image file as shown, from its header (EXIF orientation applied)."""
    from PIL import Image

    with Image.open(file) as opened:
        width, height = opened.size
        turned = opened.getexif().get(0x0112) in QUARTER_TURNS  # 0x0112: the orientation tag
    return (height, width) if turned else (width, height)


def aspect_sizes(rows: list[dict], size_of, batch_size: int) -> list[tuple]:
    """Each row's picture sizes, (height, width) each, when pictures keep their aspect: `size_of`
    (width, height) of each picture. A size fewer rows share than a batch holds takes the nearest
    one (by aspect) that enough rows of its number of pictures share, its pictures then fitted to
    it (`data.condition_fit`): a step's rows must stack, and a lone size would never be trained."""
    natural = [tuple(size_of(*image_size(file)) for file in row.get("images", ())) for row in rows]
    counts = Counter(natural)
    shared = [key for key, n in counts.items() if n >= batch_size]

    def distance(a: tuple, b: tuple) -> float:
        return sum(abs(math.log(wa / ha) - math.log(wb / hb)) for (ha, wa), (hb, wb) in zip(a, b))

    def nearest(key: tuple) -> tuple:
        same = [k for k in shared if len(k) == len(key)]
        if counts[key] >= batch_size or not same:
            return key
        return min(same, key=lambda k: (distance(k, key), k))

    return [nearest(key) for key in natural]


def text_lines(path: Path):
    """(row number, line) of a UTF-8 text file, its byte-order mark dropped; a line that is not
    UTF-8 names the file, the row and the byte (rather than a decoder's traceback)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise _row_error(path, number, f"not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}): "
                                               "save the file as UTF-8") from None


def read_records(path: Path, required_key: str, kinds: str = ".jsonl, .parquet or .txt"):
    """(row number, record) of a .jsonl or .parquet file; a bad line names the file and row."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        for number, line in text_lines(path):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as err:
                    raise _row_error(path, number, f"not valid JSON ({err.msg} at column {err.colno})") from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if required_key not in table.column_names:
            raise DatasetError(f"{path}: no `{required_key}` column (columns: {table.column_names}); set data.prompt_key")
        yield from enumerate(table.to_pylist(), start=1)
    else:
        raise DatasetError(f"data file `{path}`: unsupported type `{suffix}`; use {kinds}")


def read_prompt_file(path: str | Path, prompt_key: str = "prompt", field: str = "data.train_files",
                     check_images: bool = True) -> list[dict]:
    """The rows of a prompt file; `field` is where the path was given (named when it is wrong).
    `check_images=False` leaves the rows' condition images unopened (a count of them needs none)."""
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), field))
    if not path.is_file():
        raise DatasetError(f"prompt file `{path}` does not exist: check {field}")
    if path.suffix.lower() == ".txt":
        rows = [{"prompt": line.strip(), "data_source": path.stem, "metadata": {}}
                for _, line in text_lines(path) if line.strip()]
    else:
        rows = [_prompt_row(path, number, record, prompt_key, check_images)
                for number, record in read_records(path, prompt_key)]
    if not rows:
        raise DatasetError(f"prompt file `{path}` has no prompts")
    return rows


class PromptDataset(torch.utils.data.Dataset):
    """Rows as read: {prompt, data_source, metadata[, images]}; a drawn row with images also
    carries them decoded at `output_size` (height, width), fitted by `condition_fit`
    (`CONDITION_FITS`), as `condition_images`."""

    def __init__(self, rows: list[dict], output_size: tuple[int, int] | None = None, condition_fit: str = "crop",
                 row_sizes: list[tuple] | None = None):
        self.rows = rows
        self.output_size = output_size
        self.condition_fit = condition_fit
        self.row_sizes = row_sizes  # per row, each picture's (height, width) when they keep their aspect

    @classmethod
    def from_files(cls, files, prompt_key: str = "prompt", output_size: tuple[int, int] | None = None,
                   field: str = "data.train_files", check_images: bool = True,
                   condition_fit: str = "crop") -> "PromptDataset":
        return cls([row for f in files for row in read_prompt_file(f, prompt_key, field, check_images)], output_size,
                   condition_fit)

    def condition_counts(self) -> dict[int, int]:
        """How many rows have each number of condition images."""
        counts: dict[int, int] = {}
        for row in self.rows:
            n = len(row.get("images", ()))
            counts[n] = counts.get(n, 0) + 1
        return counts

    def bucket_counts(self) -> dict:
        """How many rows share each batching key: their number of pictures, or with pictures in
        their own aspect the sizes they are decoded at."""
        if self.row_sizes is not None:
            return dict(Counter(self.row_sizes))
        return self.condition_counts()

    def loader_buckets(self) -> list | None:
        """What the loader batches apart (`EpochSampler`'s buckets): the condition buckets."""
        return self.condition_buckets()

    @staticmethod
    def collate(rows: list[dict]) -> dict[str, list]:
        return collate_rows(rows)

    def condition_buckets(self) -> list | None:
        """Each row's batching key when the rows differ in it (a batch stacks its rows' condition
        latents, so the loader batches each number of pictures, and each size, apart), else None."""
        if len(self.bucket_counts()) < 2:
            return None
        return list(self.row_sizes) if self.row_sizes is not None else [len(row.get("images", ())) for row in self.rows]

    def keeping_aspects(self, size_of, batch_size: int) -> "PromptDataset":
        """These rows with each picture decoded in its own aspect (`aspect_sizes`)."""
        return PromptDataset(self.rows, self.output_size, self.condition_fit,
                             aspect_sizes(self.rows, size_of, batch_size))

    @classmethod
    def from_prompts(cls, prompts: list[str], data_source: str = "inline") -> "PromptDataset":
        return cls([{"prompt": p, "data_source": data_source, "metadata": {}} for p in prompts])

    def weighted(self, weights: dict[str, int]) -> "PromptDataset":
        """Each row repeated in place `weights[row's data_source]` times (1 for unlisted sources)."""
        repeats = [weights.get(row["data_source"], 1) for row in self.rows]
        return PromptDataset([row for row, k in zip(self.rows, repeats) for _ in range(k)], self.output_size,
                             self.condition_fit, None if self.row_sizes is None else
                             [sizes for sizes, k in zip(self.row_sizes, repeats) for _ in range(k)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.with_conditions(self.rows[index], index)

    def with_conditions(self, row: dict, index: int) -> dict:
        """`row` with its condition images decoded (`condition_images`), as it is when it has none."""
        if not row.get("images"):
            return row
        if self.row_sizes is not None:
            sizes = self.row_sizes[index]
        elif self.output_size is None:
            raise ValueError("a dataset with condition images needs output_size to decode them at")
        else:
            sizes = [self.output_size] * len(row["images"])
        return {**row, "condition_images": tuple(load_condition_image(f, *size, self.condition_fit)
                                                 for f, size in zip(row["images"], sizes))}


def collate_rows(rows: list[dict]) -> dict[str, list]:
    batch = {"prompts": [r["prompt"] for r in rows], "data_sources": [r["data_source"] for r in rows],
             "metadata": [r["metadata"] for r in rows]}
    if any("condition_images" in r for r in rows):
        batch["condition_images"] = [r.get("condition_images", ()) for r in rows]
    return batch


class EpochSampler(torch.utils.data.Sampler):
    """Indices in a fresh permutation each epoch (seeded by seed + epoch), resumable mid-epoch.

    The state is two integers, so a checkpoint restores exactly where the data stream was,
    epoch boundaries included. With `buckets` (a key per row, e.g. its number of condition
    images) and `batch_size`, every batch_size consecutive indices share one key: each key's rows
    are permuted and cut into whole batches (a key's remainder sits the epoch out), and the
    batches are permuted, all from seed + epoch.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int, buckets: list | None = None, batch_size: int = 1):
        self.size, self.shuffle, self.seed, self.batch_size = size, shuffle, seed, batch_size
        self.rows_by_key = None  # with buckets: each key's row indices, in key order
        if buckets is not None:
            grouped: dict = {}
            for index, key in enumerate(buckets):
                grouped.setdefault(key, []).append(index)
            self.rows_by_key = [grouped[key] for key in sorted(grouped)]
            self.size = sum(len(rows) // batch_size * batch_size for rows in self.rows_by_key)
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        if self.rows_by_key is not None:
            return self._bucketed_order()
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def _bucketed_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = []
        for rows in self.rows_by_key:
            if self.shuffle:
                rows = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            batches += [rows[i:i + self.batch_size] for i in range(0, len(rows) - self.batch_size + 1, self.batch_size)]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return [index for batch in batches for index in batch]

    def __iter__(self):
        order = self._order()
        while self.position < self.size:
            index = order[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def make_loader(dataset: torch.utils.data.Dataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool,
                collate_fn=collate_rows, buckets: list | None = None):
    """A `torchdata` StatefulDataLoader over an `EpochSampler`: its position is checkpointed.
    `buckets`: a key per row that every batch holds one of (see `EpochSampler`)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if drop_last and len(dataset) < batch_size:
        raise DatasetError(f"the dataset has {len(dataset)} prompts, fewer than data.train_batch_size = {batch_size}")
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed, buckets=buckets, batch_size=batch_size)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                              collate_fn=collate_fn, num_workers=0)
