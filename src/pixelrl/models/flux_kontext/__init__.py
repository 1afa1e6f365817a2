"""FLUX.1 Kontext (`FluxKontextPipeline`): FLUX.1's denoiser editing an image: the condition
image's latents appended to the target's tokens as a second frame; guidance as an embedding."""

from pixelrl.models.flux_kontext.model import FluxKontextModel
from pixelrl.models.flux_kontext.tiny import build_tiny_flux_kontext

__all__ = ["FluxKontextModel", "build_tiny_flux_kontext"]
