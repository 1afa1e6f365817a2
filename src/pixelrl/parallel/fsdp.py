"""How a model is spread over the data dimension: replicated from rank 0's weights, and under
FSDP2 sharded over its own wrap units, applied to the plain model before any optimizer exists
(the order torchtitan uses: the optimizer is then built over the sharded parameters)."""

from __future__ import annotations

import torch
from torch import nn


def no_split_units(module: nn.Module) -> list[nn.Module]:
    """The submodules whose class the model declares unsplittable (`_no_split_modules`, set by
    diffusers and transformers on every block type: SD3's joint blocks, FLUX's double and single
    blocks, Wan's blocks), outermost first, none nested in another; found also once FSDP2 has
    wrapped them (compiling follows sharding)."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(module).__name__} declares no `_no_split_modules`: give its FSDP units explicitly")
    units: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside or original_class_name(sub) not in names:
            continue
        units.append(sub)
        inside.update(id(m) for m in sub.modules())
    if not units:
        raise ValueError(f"{type(module).__name__} holds none of its `_no_split_modules` {sorted(names)}")
    return units


def shard_blocks(root: nn.Module, blocks: list[nn.Module], compute_dtype: torch.dtype | None = None) -> None:
    """FSDP2: one all-gather unit per block, the rest (embeddings, norms, heads) in the root's.

    `compute_dtype`: float32 master weights (full fine-tuning of a bf16 model) are all-gathered
    in that dtype and their gradients reduce-scattered in float32, torchtitan's mixed precision:
    half the bytes of gathering float32 (the bytes `pixelrl plan` counts), the same arithmetic as
    the autocast the forward runs under."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype
              else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    # FSDP2 decides which unit is the root at the first forward through it; a sub-unit called on
    # its own first (transformers' generate encodes the image before any full forward) would
    # claim that role. Settle it now.
    root._get_fsdp_state()._lazy_init()


def original_class_name(module: nn.Module) -> str:
    """The module's class name before `fully_shard`, which swaps the class for a subclass of
    (FSDPModule, the original class)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def fsdp_unit_names(root: nn.Module) -> list[str]:
    """The original class name of every module `fully_shard` wrapped under `root` (itself included)."""
    from torch.distributed.fsdp import FSDPModule

    return [original_class_name(m) for m in root.modules() if isinstance(m, FSDPModule)]


def apply_fsdp2(model) -> None:
    """Shard a DiffusionModel's denoiser over its family's units, then the root."""
    shard_blocks(model.transformer, model.fsdp_units(), model.dtype if model.float32_master_weights else None)


def parallelize_denoiser(model, mesh) -> None:
    """A DiffusionModel's denoiser across `mesh`'s ranks, once its adapters exist: every rank
    starts from rank 0's weights; with a sequence group each sample's tokens are split over it
    (before sharding: the split's hooks sit on the plain modules); under fsdp2 the denoiser is
    then sharded."""
    from pixelrl.parallel.group import broadcast_parameters

    broadcast_parameters(model.transformer)
    if mesh.sequence_size > 1:
        from pixelrl.parallel.sequence import split_sequence

        for network in model.denoiser_networks():  # each expert of a denoiser of experts
            split_sequence(network, mesh, torch.device(model.device), model.sequence_tokens,
                           "rollout.resolution or model.num_frames")
    if mesh.strategy == "fsdp2":
        apply_fsdp2(model)
        # a denoiser that routes rows between experts must agree with the other ranks on which
        # experts run: each one's blocks all-gather and reduce-scatter across every rank
        if hasattr(model.transformer, "routes_in_lockstep"):
            model.transformer.routes_in_lockstep = True
