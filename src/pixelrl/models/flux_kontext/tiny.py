"""Offline builder for a tiny random FLUX.1 Kontext folder."""

from __future__ import annotations

from pathlib import Path

from pixelrl.models.flux.tiny import build_tiny_flux


def build_tiny_flux_kontext(path: str | Path, *, resolution: int = 32, seed: int = 0, **options) -> Path:
    """A tiny FLUX.1 folder (`build_tiny_flux`, same options) saved as a `FluxKontextPipeline`,
    which `FluxKontextPipeline.from_pretrained(path)` loads with no extra arguments: Kontext has
    FLUX.1's components and takes the condition image in the pipeline, not in a new module."""
    from diffusers import FluxKontextPipeline

    return build_tiny_flux(path, resolution=resolution, seed=seed, pipeline_class=FluxKontextPipeline, **options)
