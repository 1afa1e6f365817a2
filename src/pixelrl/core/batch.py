"""`Batch`: per-sample tensors and per-sample Python values that travel together.

Every tensor has the batch on dim 0; every list in `values` has one entry per sample; `info`
holds batch-level facts (the policy version that sampled it, the SDE window, ...). Sharding,
mini-batching and gathering are index selections, so tensors and lists never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, list] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: t.shape[0] for k, t in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.values.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for t in self.tensors.values():
            return int(t.shape[0])
        for v in self.values.values():
            return len(v)
        return 0

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.values

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        return self.values[key]

    def __setitem__(self, key: str, value) -> None:
        others = self.keys() - {key}
        if others and len(value) != len(self.select_keys(others)):
            raise ValueError(f"field `{key}` has {len(value)} entries, the batch has {len(self.select_keys(others))}")
        if isinstance(value, torch.Tensor):
            self.values.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.values[key] = list(value)

    def select_keys(self, keys) -> "Batch":
        """A view with only `keys` (shares the tensors and lists)."""
        return Batch({k: t for k, t in self.tensors.items() if k in keys},
                     {k: v for k, v in self.values.items() if k in keys}, self.info)

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        idx = torch.as_tensor(index, dtype=torch.long)
        picks = idx.tolist()
        return Batch(
            {k: t[idx] for k, t in self.tensors.items()},
            {k: [v[i] for i in picks] for k, v in self.values.items()},
            dict(self.info),
        )

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of `size` samples (the last may be smaller)."""
        n = len(self)
        return [self.select(range(s, min(s + size, n))) for s in range(0, n, size)]

    def shard(self, num_shards: int) -> list["Batch"]:
        """`num_shards` equal consecutive shards; the batch size must divide evenly."""
        n = len(self)
        if n % num_shards:
            raise ValueError(f"a batch of {n} samples cannot be split evenly into {num_shards} shards")
        return self.split(n // num_shards)

    def repeat_interleave(self, n: int) -> "Batch":
        """Each sample repeated n times in place: [a, b] -> [a, a, b, b] (groups stay contiguous)."""
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def update(self, other: "Batch") -> "Batch":
        for k, t in other.tensors.items():
            self[k] = t
        for k, v in other.values.items():
            self[k] = v
        self.info.update(other.info)
        return self

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        batches = [b for b in batches]
        if not batches:
            return Batch()
        first = batches[0]
        for b in batches[1:]:
            if b.keys() != first.keys():
                raise ValueError(f"cannot concatenate batches with keys {sorted(first.keys())} and {sorted(b.keys())}")
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: [x for b in batches for x in b.values[k]] for k in first.values},
            dict(first.info),
        )

    # Transport: numpy arrays move through Ray's object store without pickling torch storages.
    def to_numpy(self) -> dict:
        return {
            "tensors": {k: t.detach().cpu().numpy() for k, t in self.tensors.items()},
            "values": self.values,
            "info": self.info,
        }

    @staticmethod
    def from_numpy(payload: dict) -> "Batch":
        return Batch(
            {k: torch.from_numpy(np.array(a, copy=True)) for k, a in payload["tensors"].items()},
            {k: list(v) for k, v in payload["values"].items()},
            dict(payload["info"]),
        )
