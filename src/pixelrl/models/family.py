"""What pixelrl knows about a model family besides its adapter: a `FamilySpec`.

Each family folder holds one (`models/<family>/spec.py`, `SPEC`): the adapter class, the published
release's shape (for planning a model that is not on this machine, and for the GPU benchmark's
random-weight folders), the denoiser's cost per row (tokens, FLOPs, latent values) and the tiny
builder. `pixelrl plan`, `build-tiny` and the benchmarks find a family only through its spec, so
adding a family touches its folder and one line in `models/loader.py` (or a plugin's
`register_family`), and a family nobody described is an error, never another family's formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Published parameter counts of the text encoders and VAEs several releases share.
CLIP_L, CLIP_G, T5_XXL, UMT5_XXL, QWEN25_VL_7B = 123.1e6, 694.7e6, 4.762e9, 5.68e9, 8.29e9
SD3_VAE_PARAMS, WAN_VAE_PARAMS = 83.7e6, 126.9e6


@dataclass(frozen=True)
class Release:
    """A published model a family stands for: its denoiser config (`transformer/config.json`)
    and the parameter counts of its parts."""

    name: str
    transformer: dict
    denoiser_params: float
    # text encoders by component folder; a family may leave one unloaded (SD3's T5 at 0 tokens)
    encoder_params: dict = field(default_factory=dict)
    vae_params: float = 0.0


@dataclass(frozen=True)
class RowInput:
    """What one row (one sample, one CFG branch) feeds the denoiser."""

    height: int
    width: int
    frames: int  # decoded frames (1 for images)
    text_tokens: int  # the family's text tokens in the joint sequence (FamilySpec.text_tokens)
    unit: int = 16  # pixels per token side: VAE scale x patch size (16 in every release)
    # condition images in the sequence (an edit family's source), each condition_side pixels a side
    # (0: the target's height and width)
    condition_images: int = 0
    condition_side: int = 0


@dataclass(frozen=True)
class DenoiserCost:
    """One row's denoiser forward: matmuls count 2 x the weights each token passes through,
    attention 4 x hidden x (query tokens x key tokens) per layer."""

    layers: int
    hidden: int
    tokens: int  # in the denoiser's sequence (image + joint text)
    forward_flops: float
    latent_values: int  # one sample's latent (all frames): what a stored trajectory step holds


@dataclass(frozen=True)
class FamilySpec:
    name: str  # model.type
    model_class: type  # the DiffusionModel subclass
    release: Release | None
    cost: Callable[[dict, RowInput], DenoiserCost]  # (transformer config, row) -> cost
    # (model.max_sequence_length) -> text tokens in the joint sequence
    text_tokens: Callable[[int], int]
    # (component folder name, model.max_sequence_length) -> whether a run loads it
    loads_component: Callable[[str, int], bool] = lambda name, max_sequence_length: True
    # build_tiny(path, *, resolution, seed, **tiny_options) -> Path
    build_tiny: Callable[..., Path] | None = None
    tiny_options: tuple[str, ...] = ()  # keyword options build_tiny takes beyond resolution and seed
    # whose model's sequence trainer.sequence_parallel_size may split: its diffusers model has a
    # context-parallel plan and its DiffusionModel says how long the split sequence is
    splits_sequence: bool = False


def tokens_per_side(side: int, unit: int) -> int:
    return side // unit


def joint_attention_cost(c: dict, row: RowInput) -> DenoiserCost:
    """Packed 2 x 2 latents and joint attention over image and text in every block (FLUX,
    Qwen-Image): the double-stream and single-stream layers cost the same per token. An edit
    family's condition images join the sequence as tokens of their own (FLUX.1 Kontext)."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    image = tokens_per_side(row.height, row.unit) * tokens_per_side(row.width, row.unit)
    condition = tokens_per_side(row.condition_side, row.unit) ** 2 if row.condition_side else image
    layers = c["num_layers"] + c.get("num_single_layers", 0)
    seq = image + condition * row.condition_images + row.text_tokens
    flops = 2 * seq * layers * 12 * d * d + 4 * d * layers * seq * seq
    return DenoiserCost(layers, d, seq, float(flops), image * c.get("in_channels", 64))
