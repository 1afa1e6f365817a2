"""FLUX.1 (`FluxPipeline`): double- and single-stream transformer over packed latents, CLIP pooled
+ T5 tokens, guidance as an embedding input (no CFG batch), resolution-dependent sigma shift."""

from pixelrl.models.flux.model import FLUX_LORA_TARGETS, FluxModel
from pixelrl.models.flux.tiny import build_tiny_flux

__all__ = ["FluxModel", "FLUX_LORA_TARGETS", "build_tiny_flux"]
