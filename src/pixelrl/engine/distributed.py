"""Data parallelism inside a worker group: DDP-style gradient averaging or FSDP2 sharding.

The group is a torch.distributed process group (gloo on CPU, NCCL on CUDA) formed by the
workers themselves; the engine stays unaware of Ray.

- `ddp`: every rank holds the full model; after a mini-batch's backward passes the trainable
  gradients are averaged with one flat all-reduce (what DDP does under `no_sync`
  accumulation), then every rank takes the same optimizer step.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on the model family's units and the root
  (`pixelrl.models.parallelize`, applied before the optimizer is built); every
  forward all-gathers parameters and every backward reduce-scatters gradients, so all ranks
  must run the same number of forwards (the config validation enforces equal shards).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def loopback_interface() -> str | None:
    """The name of the network interface holding 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address == "127.0.0.1" for a in addrs)), None)


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str = "cpu",
                       listen_socket: socket.socket | None = None) -> None:
    """Join the group whose store rank 0 serves at master_addr:master_port. Rank 0 passes the
    socket it bound there (`listen_socket`), so the store listens on that address only rather
    than on every interface; with a loopback master, gloo's and NCCL's own connections stay on
    loopback too."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if master_addr == "127.0.0.1" and (interface := loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if rank == 0 and listen_socket is not None:
        # the store owns the descriptor from here (detach: Python must not close it under it)
        store = dist.TCPStore(master_addr, master_port, world_size, True, timeout,
                              master_listen_fd=listen_socket.detach(), use_libuv=False)
    else:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.barrier()  # gloo aborts at exit if a peer is gone before everyone is done
        dist.destroy_process_group()


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Make every rank start from rank 0's weights (trainable or not)."""
    with torch.no_grad():
        for param in module.parameters():
            dist.broadcast(param.data, src=0)


def ddp_grad_sync(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks in one flat all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n


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


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over ranks (a no-op in one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def full_trainable_state(module: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of the named parameters; works for plain and FSDP2 modules."""
    params = dict(module.named_parameters())
    return {name: full_tensor(params[name]) for name in names}


def load_trainable_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters."""
    params = dict(module.named_parameters())
    for name, value in state.items():
        copy_full_into(params[name], value)
