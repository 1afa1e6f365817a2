"""Released reward-model checkpoints -> transformers folders, without running code from them.

The published weights of ImageReward and HPSv2 are PyTorch pickles of plain state dicts. They
are read with `torch.load(weights_only=True)`, which unpickles tensors and containers only, so
nothing named by the file executes; the tensors are renamed into a transformers model built from
a local base folder's config and saved as safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from pixelrl.core.errors import ModelFolderError


def read_state_dict(checkpoint: str | Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a released checkpoint (a state dict, or a dict holding one as
    `state_dict`); anything else stops with one message naming the file."""
    try:
        state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickled objects other than tensors are refused, as is a damaged file
        raise ModelFolderError(f"checkpoint `{checkpoint}`: not readable as tensors only ({str(exc)[:200]})") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelFolderError(f"checkpoint `{checkpoint}`: not a state dict of tensors ({what} is one)")
    return state


def rename(checkpoint: str | Path, convert: Callable, state: dict):
    """`convert(state)`, with its complaint about foreign tensors as one message naming the file."""
    try:
        return convert(state)
    except ValueError as exc:
        raise ModelFolderError(f"checkpoint `{checkpoint}`: {exc}") from None


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], checkpoint: str | Path,
                 base: str | Path, expected: Callable[[str], bool]) -> None:
    """Load the renamed `weights` into `model` (built from the base folder's config): every tensor
    `expected` names must be there, and every shape must fit."""
    missing = sorted(k for k in model.state_dict() if expected(k) and not k.endswith("position_ids")
                     and k not in weights)
    if missing:
        raise ModelFolderError(f"checkpoint `{checkpoint}` lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # a tensor of another shape: a base folder of another size
        raise ModelFolderError(f"base folder `{base}`: its config does not fit the checkpoint ({str(exc)[:300]}); "
                               "use the folder of the checkpoint's base model") from None
    if result.unexpected_keys:
        raise ModelFolderError(f"base folder `{base}`: its config does not fit the checkpoint "
                               f"(unexpected {result.unexpected_keys[:3]})")
