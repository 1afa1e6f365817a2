"""Data parallelism inside a worker group: DDP-style gradient averaging or FSDP2 sharding.

The group is a torch.distributed process group (gloo on CPU, NCCL on CUDA) formed by the
workers themselves; the engine stays unaware of Ray.

- `ddp`: every rank holds the full model; after a mini-batch's backward passes the trainable
  gradients are averaged with one flat all-reduce (what DDP does under `no_sync`
  accumulation), then every rank takes the same optimizer step.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on each transformer block and the root; every
  forward all-gathers parameters and every backward reduce-scatters gradients, so all ranks
  must run the same number of forwards (the config validation enforces equal shards).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str = "cpu") -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=10))


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


def apply_fsdp2(transformer: torch.nn.Module) -> None:
    """Shard each transformer block, then the root module (FSDP2 / fully_shard)."""
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise ValueError("fsdp2 needs a transformer with `transformer_blocks` to shard")
    for block in blocks:
        fully_shard(block)
    fully_shard(transformer)


def full_trainable_state(module: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of the named parameters; works for plain and FSDP2 modules."""
    from torch.distributed.tensor import DTensor

    out = {}
    params = dict(module.named_parameters())
    for name in names:
        value = params[name].detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.cpu().clone()
    return out


def load_trainable_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            param = params[name]
            if isinstance(param.data, DTensor):
                local = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
                param.data.copy_(local)
            else:
                param.data.copy_(value.to(param.dtype))
