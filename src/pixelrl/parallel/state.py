"""Full copies of plain or FSDP2-sharded weights and optimizer state: what a checkpoint writes and
reads, and what a rollout worker is sent. Every rank of a group must call these together."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A full CPU copy of a plain or FSDP2-sharded (DTensor) tensor; every rank must call it."""
    from torch.distributed.tensor import DTensor

    value = value.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.cpu().clone()


def copy_full_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full tensor into a plain or sharded (DTensor) one, in place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(target.data, DTensor):
            target.data.copy_(distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements))
        else:
            target.data.copy_(value.to(target.dtype))


def optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as full CPU tensors keyed by parameter name (gathered over ranks
    when a process group exists; every rank must call it)."""
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
    return optimizer.state_dict()


def set_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


def full_trainable_state(module: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of the named parameters; works for plain and FSDP2 modules."""
    params = dict(module.named_parameters())
    return {name: full_tensor(params[name]) for name in names}


def load_trainable_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters."""
    params = dict(module.named_parameters())
    for name, value in state.items():
        copy_full_into(params[name], value)
