"""Prompt datasets (jsonl, parquet, txt) and stateful loaders.

A row has a `prompt` (the column name is configurable), and optionally `data_source` (used to
group validation metrics) and `metadata` (a dict handed to reward functions, e.g. the ground
truth of a compositional prompt). A bad row stops loading with the file and row number.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def read_records(path: Path, required_key: str, kinds: str = ".jsonl, .parquet or .txt"):
    """(row number, record) of a .jsonl or .parquet file; a bad line names the file and row."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8-sig") as handle:  # a byte-order mark is not part of the first row
            for number, line in enumerate(handle, start=1):
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


def read_prompt_file(path: str | Path, prompt_key: str = "prompt") -> list[dict]:
    from pixelrl.core.assets import resolve

    path = Path(resolve(str(path), "data.train_files"))
    if not path.is_file():
        raise DatasetError(f"prompt file `{path}` does not exist: check data.train_files / data.val_files")
    if path.suffix.lower() == ".txt":
        rows = [{"prompt": line.strip(), "data_source": path.stem, "metadata": {}}
                for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    else:
        rows = [_normalise(path, number, record, prompt_key) for number, record in read_records(path, prompt_key)]
    if not rows:
        raise DatasetError(f"prompt file `{path}` has no prompts")
    return rows


class PromptDataset(torch.utils.data.Dataset):
    """Rows as read: {prompt, data_source, metadata}."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    @classmethod
    def from_files(cls, files, prompt_key: str = "prompt") -> "PromptDataset":
        return cls([row for f in files for row in read_prompt_file(f, prompt_key)])

    @classmethod
    def from_prompts(cls, prompts: list[str], data_source: str = "inline") -> "PromptDataset":
        return cls([{"prompt": p, "data_source": data_source, "metadata": {}} for p in prompts])

    def weighted(self, weights: dict[str, int]) -> "PromptDataset":
        """Each row repeated in place `weights[row's data_source]` times (1 for unlisted sources)."""
        return PromptDataset([row for row in self.rows for _ in range(weights.get(row["data_source"], 1))])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def collate_rows(rows: list[dict]) -> dict[str, list]:
    return {"prompts": [r["prompt"] for r in rows], "data_sources": [r["data_source"] for r in rows],
            "metadata": [r["metadata"] for r in rows]}


class EpochSampler(torch.utils.data.Sampler):
    """Indices in a fresh permutation each epoch (seeded by seed + epoch), resumable mid-epoch.

    The state is two integers, so a checkpoint restores exactly where the data stream was,
    epoch boundaries included.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

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
                collate_fn=collate_rows):
    """A `torchdata` StatefulDataLoader over an `EpochSampler`: its position is checkpointed."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if drop_last and len(dataset) < batch_size:
        raise DatasetError(f"the dataset has {len(dataset)} prompts, fewer than data.train_batch_size = {batch_size}")
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                              collate_fn=collate_fn, num_workers=0)
