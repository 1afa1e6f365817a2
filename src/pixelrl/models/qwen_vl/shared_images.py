"""Encode each distinct image of a batch once.

GRPO and PPO batches repeat every prompt: the n responses to a question share its image, and so do
the rows of a critic, reference or EMA forward over them. Qwen2-VL's vision tower would encode that
image n times. `encode_each_image_once` hooks the vision tower so that a batch's images are
grouped by content, each distinct one is encoded once, and its features are copied back to every
row that holds it. The copy is an index into the encoded features, so the backward pass sums the
rows' gradients into the one encoding: the same gradient as n separate encodings, at 1/n of the
vision cost in sampling (the prefill), scoring and training alike.

Images are matched by content, never by position, because training shuffles rows into
mini-batches: a fingerprint per image (two weighted sums of its patches, computed on the device,
each image reduced on its own so that equal images give equal sums) proposes matches and `torch.equal` confirms each one, so two images share an encoding
only when every pixel value is equal.
"""

from __future__ import annotations

import torch
from torch import nn


class _EncodeOnce:
    """Forward pre-hook and hook pair on a Qwen2-VL vision tower (`visual(pixels, grid_thw=...)`)."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        pixels = args[0] if args else kwargs.get("hidden_states")
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        plan = None if pixels is None or grid is None or len(grid) < 2 else _plan(pixels, grid)
        self.pending.append(plan)
        if plan is None:
            return None
        unique_rows, _ = plan
        chunks = torch.split(pixels, grid.prod(-1).tolist())
        unique_pixels = torch.cat([chunks[i] for i in unique_rows.tolist()])
        kwargs = {**kwargs, "grid_thw": grid[unique_rows]}
        kwargs.pop("hidden_states", None)
        return (unique_pixels, *args[2:]) if args else (unique_pixels,), kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output):
        plan = self.pending.pop()
        if plan is None:
            return None
        unique_rows, image_of_row = plan
        grid = kwargs["grid_thw"]  # the unique images' grids, as the pre-hook passed them
        merge = getattr(module, "spatial_merge_size", 2) ** 2
        for name, per_image in (("last_hidden_state", grid.prod(-1)), ("pooler_output", grid.prod(-1) // merge)):
            features = getattr(output, name, None)
            if features is not None:
                setattr(output, name, features.index_select(0, _rows_index(per_image, image_of_row)))
        return output


def group_equal(pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the first occurrence of each distinct image, index of each row's distinct image)
    for a batch of images packed as Qwen2-VL packs them (`pixels` [sum of patches, patch dim],
    `grid` [images, 3])."""
    sizes = grid.prod(-1)
    # per patch a fixed projection, per image its sum and its patch-position-weighted sum, each
    # image reduced on its own (no atomics: equal images give equal sums on every device, so they
    # are found; torch.equal below settles any collision of unequal ones)
    probe = torch.linspace(1.0, 2.0, pixels.shape[-1], device=pixels.device, dtype=torch.float32)
    per_patch = pixels.to(torch.float32) @ probe
    fingerprint = torch.stack([
        torch.stack([part.sum(), (part * torch.arange(1, len(part) + 1, device=part.device)).sum()])
        for part in torch.split(per_patch, sizes.tolist())])
    chunks = torch.split(pixels, sizes.tolist())
    keys = [(tuple(g), *f) for g, f in zip(grid.tolist(), fingerprint.tolist())]
    seen: dict[tuple, list[int]] = {}
    unique_rows: list[int] = []
    image_of_row: list[int] = []
    for row, key in enumerate(keys):
        match = next((u for u in seen.get(key, ()) if torch.equal(chunks[unique_rows[u]], chunks[row])), None)
        if match is None:
            match = len(unique_rows)
            unique_rows.append(row)
            seen.setdefault(key, []).append(match)
        image_of_row.append(match)
    device = grid.device
    return torch.tensor(unique_rows, device=device), torch.tensor(image_of_row, device=device)


def _plan(pixels: torch.Tensor, grid: torch.Tensor):
    """`group_equal`'s answer, or None when every image is distinct."""
    unique_rows, image_of_row = group_equal(pixels, grid)
    return None if len(unique_rows) == len(image_of_row) else (unique_rows, image_of_row)


def _rows_index(per_image: torch.Tensor, image_of_row: torch.Tensor) -> torch.Tensor:
    """Indices into the unique images' concatenated features that lay them out row by row."""
    starts = torch.cumsum(per_image, 0) - per_image
    counts = per_image[image_of_row]
    first = torch.repeat_interleave(starts[image_of_row], counts)
    offset = torch.arange(int(counts.sum()), device=per_image.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts)
    return first + offset


def encode_each_image_once(model: nn.Module) -> None:
    """Hook the vision tower of a Qwen2-VL model (the `...ForConditionalGeneration` or its inner
    `Qwen2VLModel`) so that each distinct image of a forward is encoded once."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None:
        raise TypeError(f"{type(model).__name__} has no Qwen2-VL vision tower (`.visual`) to hook")
    hooks = _EncodeOnce()
    visual.register_forward_pre_hook(hooks.before, with_kwargs=True)
    visual.register_forward_hook(hooks.after, with_kwargs=True)
