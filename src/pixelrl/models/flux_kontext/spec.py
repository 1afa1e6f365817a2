"""FLUX.1 Kontext as the planner, the benchmarks and `build-tiny` see it."""

from __future__ import annotations

from pixelrl.models.family import FamilySpec, Release
from pixelrl.models.flux.spec import SPEC as FLUX
from pixelrl.models.flux_kontext.model import FluxKontextModel
from pixelrl.models.flux_kontext.tiny import build_tiny_flux_kontext

SPEC = FamilySpec(
    name="flux_kontext", model_class=FluxKontextModel,
    # black-forest-labs/FLUX.1-Kontext-dev: FLUX.1-dev's transformer config, encoders and VAE
    release=Release("FLUX.1-Kontext-dev", FLUX.release.transformer, FLUX.release.denoiser_params,
                    FLUX.release.encoder_params, FLUX.release.vae_params),
    cost=FLUX.cost,  # joint attention over target, condition and text tokens (RowInput.condition_images)
    text_tokens=FLUX.text_tokens,
    build_tiny=build_tiny_flux_kontext)
