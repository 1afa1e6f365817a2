"""`PolicyWorker`: one rank of the actor group. Wraps a PolicyEngine; moves batches as numpy.

The same class runs in-process (`trainer.backend=local`) or as a Ray actor; it holds no
algorithm math, only placement, distribution and transport.
"""

from __future__ import annotations

import os
import socket

from pixelrl.core.batch import Batch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class PolicyWorker:
    def __init__(self, cfg_yaml: str, rank: int = 0, world_size: int = 1, num_threads: int | None = None):
        self.cfg_yaml, self.rank, self.world_size = cfg_yaml, rank, world_size
        self.num_threads = num_threads
        self.engine = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group."""
        return socket.gethostbyname(socket.gethostname()), _free_port()

    def setup(self, master: tuple[str, int] | None = None) -> dict:
        import torch

        from pixelrl.core.config_loading import from_yaml_text
        from pixelrl.core.quiet import quiet_libraries
        from pixelrl.engine import PolicyEngine
        from pixelrl.engine.distributed import apply_fsdp2, broadcast_parameters, ddp_grad_sync, init_process_group
        from pixelrl.models import load_model

        quiet_libraries()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        cfg = from_yaml_text(self.cfg_yaml)
        if self.world_size > 1:
            init_process_group(self.rank, self.world_size, master[0], master[1], cfg.model.device)
        model = load_model(cfg.model.type, cfg.model.path, device=cfg.model.device, dtype=cfg.model.dtype,
                           max_sequence_length=cfg.model.max_sequence_length)
        self.engine = PolicyEngine(model, cfg)
        self.engine.data_parallel_size = self.world_size
        if self.world_size > 1:
            broadcast_parameters(model.transformer)
            if cfg.trainer.strategy == "fsdp2":
                apply_fsdp2(model.transformer)
                # FSDP2 made the parameters DTensors: the optimizer must see the sharded ones.
                self.engine.learner.rebuild()
            else:
                self.engine.learner.grad_sync = ddp_grad_sync
        return {"rank": self.rank, "pid": os.getpid(), "trainable": len(self.engine.trainable_names())}

    # --- the engine's verbs, with numpy transport -------------------------------------
    def rollout(self, prompts: list[str], seeds: list[int], window, settings=None, num_steps=None,
                noise_seeds=None, policy="current") -> dict:
        from pixelrl.sampling.rollout import SamplingSettings
        from pixelrl.sampling.windows import Window

        batch = self.engine.rollout(prompts, seeds, window=Window(*window) if window is not None else None,
                                    settings=SamplingSettings(**settings) if settings else None, num_steps=num_steps,
                                    noise_seeds=noise_seeds, policy=policy)
        return batch.to_numpy()

    def score(self, payload: dict, policy: str) -> dict:
        return self.engine.score(Batch.from_numpy(payload), policy).to_numpy()

    def encode(self, payload: dict) -> dict:
        return self.engine.encode(Batch.from_numpy(payload)).to_numpy()

    def update(self, payload: dict) -> dict:
        return self.engine.update(Batch.from_numpy(payload))

    def trainable_state(self) -> dict:
        """This rank's full (unsharded) trainable weights as numpy arrays (to check ranks agree)."""
        from pixelrl.engine.distributed import full_trainable_state

        state = full_trainable_state(self.engine.model.transformer, self.engine.trainable_names())
        return {k: v.numpy() for k, v in state.items()}

    # --- checkpoints ----------------------------------------------------------------------
    def save(self, folder: str) -> None:
        from pixelrl.engine.checkpoint import save_engine

        save_engine(self.engine, folder, write=self.rank == 0)

    def load(self, folder: str) -> dict:
        from pixelrl.engine.checkpoint import load_engine

        load_engine(self.engine, folder)
        return self.engine.counters()

    def counters(self) -> dict:
        return self.engine.counters()

    def shutdown(self) -> None:
        from pixelrl.engine.distributed import destroy_process_group

        if self.world_size > 1:
            destroy_process_group()
