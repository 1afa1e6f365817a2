"""Statistics of generated images that no reward looks at, logged at every validation.

A reward can be hacked in ways it cannot see: an OCR reward that drives the background black, a
preference model that pays for grain or brightness (UniRL PR #407: dark fraction 0.45 -> 0.93,
edge density -60%, colour entropy -54%, found by hand). Each validation logs these means over its
images, and each one's drift from the run's first validation, so the drift is in the run's
metrics and report beside the reward:

- `dark_fraction`: share of pixels whose brightest channel is below 32 (of 255);
- `brightness`: mean luma (0.299 R + 0.587 G + 0.114 B) / 255;
- `saturation`: mean HSV saturation, (max - min) / max per pixel (0 on black);
- `colour_entropy`: entropy in bits of the colours quantised to 4 levels a channel (at most 6);
- `edge_density`: share of pixels where the luma changes by more than 32 to its right or lower
  neighbour;
- `grain`: mean |luma - its 3 x 3 box blur| / 255, the high-frequency energy that speckle adds.

Beside them, two of the samples: `x0_rms`, the clean sample's root mean square before decoding,
and for edits `source_distance`, how far an edit moved from its source.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DARK_LEVEL = 32
EDGE_STEP = 32
STATISTICS = ("dark_fraction", "brightness", "saturation", "colour_entropy", "edge_density", "grain")
SAMPLE_STATISTICS = ("x0_rms", "source_distance")  # of the samples, not their pixels; source_distance of edits
WATCHABLE = STATISTICS + SAMPLE_STATISTICS


def _luma(rgb: torch.Tensor) -> torch.Tensor:
    """[B, H, W] luma of float RGB in 0..255."""
    return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


def image_statistics(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each statistic per image ([B] each) of uint8 images [B, H, W, 3]."""
    rgb = images.float()
    top, low = rgb.amax(-1), rgb.amin(-1)
    y = _luma(rgb)
    levels = (images.long() // 64)  # 4 levels a channel
    codes = (levels[..., 0] * 16 + levels[..., 1] * 4 + levels[..., 2]).flatten(1)
    counts = torch.zeros(codes.shape[0], 64).scatter_add_(1, codes, torch.ones_like(codes, dtype=torch.float))
    p = counts / counts.sum(1, keepdim=True)
    entropy = -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(1)
    dx = (y[:, :, 1:] - y[:, :, :-1]).abs() > EDGE_STEP
    dy = (y[:, 1:, :] - y[:, :-1, :]).abs() > EDGE_STEP
    edges = torch.zeros_like(y, dtype=torch.bool)
    edges[:, :, :-1] |= dx
    edges[:, :-1, :] |= dy
    blurred = F.avg_pool2d(y[:, None], 3, stride=1, padding=1, count_include_pad=False)[:, 0]
    return {
        "dark_fraction": (top < DARK_LEVEL).float().flatten(1).mean(1),
        "brightness": y.flatten(1).mean(1) / 255.0,
        "saturation": torch.where(top > 0, (top - low) / top.clamp_min(1e-6), torch.zeros_like(top)).flatten(1).mean(1),
        "colour_entropy": entropy,
        "edge_density": edges.float().flatten(1).mean(1),
        "grain": (y - blurred).abs().flatten(1).mean(1) / 255.0,
    }


def mean_image_statistics(images) -> dict[str, float]:
    """The statistics' means over a validation's images: a [B, H, W, 3] tensor, or a list of
    [H, W, 3] images of several sizes (edits in their sources' aspects); a video's frames
    ([B, T, H, W, 3]) count as images."""
    parts = [images] if torch.is_tensor(images) else [image[None] for image in images]
    per_image = [image_statistics(part.flatten(0, 1) if part.ndim == 5 else part) for part in parts]
    return {name: float(torch.cat([s[name] for s in per_image]).mean()) for name in STATISTICS}


def x0_rms(x0: torch.Tensor) -> torch.Tensor:
    """[B] root mean square of each clean sample x0 (latents, or pixels in [-1, 1] without a VAE),
    a size that does not grow with the resolution: a policy whose x0 drifts outward brightens and
    saturates its images while the reward looks stable."""
    return x0.flatten(1).float().pow(2).mean(1).sqrt()


def source_distance(images, condition_images) -> float:
    """Mean |edit - its first source| / 255 over the images (0: the source untouched), each source
    at its edit's size; `images` a [B, H, W, 3] tensor or a list of edits of several sizes."""
    from pixelrl.rewards.source import first_sources

    distances = [(image.float() - first_sources([sources], tuple(image.shape[:2]))[0].float()).abs().mean() / 255.0
                 for image, sources in zip(images, condition_images)]
    return float(torch.stack(distances).mean())


class StatisticsDrift:
    """The run's first validation's statistics, and each later one's drift from them. A resumed
    run reads the first values back from its first validation's metrics row (`seed`). Beside the
    image statistics, a validation passes the sample statistics it has (`x0_rms`, and for edits
    `source_distance`): each drifts from the first validation that logged it."""

    def __init__(self):
        self.first: dict[str, float] = {}

    def seed(self, row: dict | None, prefix: str = "val-aux/image") -> None:
        self.first = {name: row[f"{prefix}/{name}"] for name in WATCHABLE if f"{prefix}/{name}" in (row or {})}

    def metrics(self, images, samples: dict[str, float] | None = None,
                prefix: str = "val-aux/image") -> dict[str, float]:
        values = {**mean_image_statistics(images), **(samples or {})}
        for name, value in values.items():
            self.first.setdefault(name, value)
        out = {f"{prefix}/{name}": value for name, value in values.items()}
        out.update({f"{prefix}/{name}_drift": value - self.first[name] for name, value in values.items()})
        return out
