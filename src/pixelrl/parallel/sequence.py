"""Sequence parallelism: one sample's tokens split over the ranks of a sequence group (Ulysses).

Each rank of the group holds the same rows and 1/P of every sample's video or image tokens
between the denoiser's split and gather points. Self-attention swaps the split before and after
itself with two all-to-alls (tokens gathered, heads scattered, then back), so each rank attends
over the whole sequence for H/P of the heads: the same arithmetic as one rank, reordered.
Cross-attention to the text needs none (its queries stay local, its keys are whole).

Where a family's sequence is split and gathered is its diffusers model's own context-parallel
plan (`_cp_plan`); the attention all-to-alls are diffusers' Ulysses templates. The output is
gathered whole on every rank of the group, so log-probs, KL, losses and metrics are computed
on whole samples exactly as without sequence parallelism. Its backward hands each rank only its
own tokens' gradient, so a parameter's gradient is the sum over the group (`Mesh.grad_sync`,
FSDP2's divide factor).
"""

from __future__ import annotations

from typing import Callable

import torch

from pixelrl.core.errors import ConfigError


def check_even_split(tokens: int, mesh, sizes: str) -> None:
    """A sample's `tokens` must split into equal parts over the sequence group (diffusers' own
    check is an assert deep in the forward); `sizes` names the fields that set the count."""
    if tokens % mesh.sequence_size:
        raise ConfigError("trainer.sequence_parallel_size", mesh.sequence_size,
                          f"a sample's {tokens} tokens do not split evenly over a sequence group of "
                          f"{mesh.sequence_size}: change {sizes} so that they do, or the group size")


def split_sequence(transformer: torch.nn.Module, mesh, device: torch.device,
                   tokens_of: Callable[[torch.Tensor], int], sizes: str) -> None:
    """Install the Ulysses split on `transformer` (a diffusers model with a `_cp_plan`) for
    `mesh`'s sequence groups; every rank of the process group must call it. `tokens_of(latents)`
    is the split sequence's length, checked before every forward."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    plan = getattr(transformer, "_cp_plan", None)
    if not plan:
        raise ValueError(f"{type(transformer).__name__} has no context-parallel plan (`_cp_plan`): "
                         "its sequence cannot be split")
    # diffusers' own `enable_parallelism` places the config on an accelerator (it divides by
    # the accelerator count, zero on a CPU): the same steps here take the mesh's device
    device_mesh = init_device_mesh(device.type, (mesh.data_size, 1, mesh.sequence_size),
                                   mesh_dim_names=("data", "ring", "ulysses"))
    context = ContextParallelConfig(ulysses_degree=mesh.sequence_size)
    config = ParallelConfig(context_parallel_config=context)
    config.setup(mesh.rank, mesh.world_size, device, mesh=device_mesh["ring", "ulysses"])
    transformer._parallel_config = config
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(transformer, context, plan)
    def check(module, args, kwargs) -> None:
        check_even_split(tokens_of(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]), mesh, sizes)

    transformer.register_forward_pre_hook(check, with_kwargs=True)
