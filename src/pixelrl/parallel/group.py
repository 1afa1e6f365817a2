"""The process group and this rank's place in the run's device mesh.

The group is a torch.distributed process group (gloo on CPU, NCCL on CUDA) formed by the
workers themselves; the engine stays unaware of Ray. The mesh has two dimensions, sequence
innermost: `data` (ranks that hold different rows) and `sequence` (ranks that hold the same rows
and split each sample's tokens; size 1 unless the run asks for sequence parallelism), so the
ranks of one sequence group are consecutive.

- `ddp`: every rank holds the full model; after a mini-batch's backward passes the trainable
  gradients are reduced with one flat all-reduce (what DDP does under `no_sync` accumulation),
  then every rank takes the same optimizer step.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on the model family's units and the root
  (`fsdp.py`, applied before the optimizer is built); every forward all-gathers parameters and
  every backward reduce-scatters gradients, so all ranks must run the same number of forwards
  (the config validation enforces equal shards).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the data x sequence mesh of `world_size` ranks."""

    world_size: int = 1
    rank: int = 0
    strategy: str = "ddp"  # how the data dimension holds the weights: ddp | fsdp2
    sequence_size: int = 1

    def __post_init__(self):
        if self.world_size % self.sequence_size:
            raise ValueError(f"{self.world_size} ranks do not split into sequence groups of {self.sequence_size}")

    @property
    def data_size(self) -> int:
        """Ranks holding different rows: the number every per-rank row count is multiplied by."""
        return self.world_size // self.sequence_size

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def syncs_gradients(self) -> bool:
        """Whether a learner must call `grad_sync` after its backward passes (FSDP2 reduces by itself,
        as a mean over every rank)."""
        return self.distributed and (self.strategy == "ddp" or self.sequence_size > 1)

    def grad_sync(self, params: list[torch.nn.Parameter]) -> None:
        """Each gradient becomes the mean over data ranks (each rank's loss is a mean over its own
        rows) of the sum over a sequence group (each of its ranks holds the gradient of its own
        tokens' share of the same rows): one flat all-reduce under ddp; under fsdp2, whose
        reduce-scatter took the mean over every rank, the sequence group's size times it (exact
        for a power of two; FSDP2's own divide factor needs a pre-multiplied sum gloo lacks)."""
        if self.strategy == "fsdp2":
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.sequence_size)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.data_size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).clone()
            offset += n


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over ranks (a no-op in one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values
