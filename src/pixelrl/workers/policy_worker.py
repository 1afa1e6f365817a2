"""`PolicyWorker`: one rank of the actor group. Wraps a PolicyEngine; moves batches as numpy.

The same class runs in-process (`trainer.backend=local`) or as a Ray actor; it holds no
algorithm math, only placement, distribution and transport.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from pixelrl.core.batch import Batch
from pixelrl.engine.memory import naming_the_phase


class RankProcess:
    """What every worker of a data-parallel group does the same way: say where rank 0 listens,
    read the config, set its threads and join the torch.distributed group."""

    def __init__(self, cfg_yaml: str, rank: int = 0, world_size: int = 1, num_threads: int | None = None):
        self.cfg_yaml, self.rank, self.world_size = cfg_yaml, rank, world_size
        self.num_threads = num_threads
        self._store_socket: socket.socket | None = None
        self._profiler = None  # a StepProfiler while trainer.profile_step runs

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group."""
        # on the loopback-only node pixelrl starts itself, the group stays on loopback too; on a
        # cluster, this host's address. The socket stays bound until the store takes it, so no
        # other process can take the port in between.
        import ray

        host = "127.0.0.1" if ray.util.get_node_ip_address() == "127.0.0.1" else socket.gethostbyname(socket.gethostname())
        self._store_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._store_socket.bind((host, 0))
        return host, self._store_socket.getsockname()[1]

    def _join(self, master: tuple[str, int] | None):
        """The config, with this process's threads set and (for > 1 rank) the group joined."""
        import torch

        from pixelrl.config.sections import from_yaml_text
        from pixelrl.core.plugins import import_plugins
        from pixelrl.core.quiet import quiet_libraries
        from pixelrl.parallel.group import init_process_group

        quiet_libraries()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        cfg = from_yaml_text(self.cfg_yaml)
        import_plugins(cfg.plugins)  # the driver's list, from the config it validated
        if self.world_size > 1:
            listen_socket, self._store_socket = self._store_socket, None  # rank 0's, from address()
            init_process_group(self.rank, self.world_size, master[0], master[1], cfg.model.device, listen_socket)
        return cfg

    # --- trainer.profile_step -------------------------------------------------------------
    def device(self):
        """Where this rank's model runs (each worker class says)."""
        raise NotImplementedError

    def start_profile(self) -> None:
        from pixelrl.engine.profiling import StepProfiler

        self._profiler = StepProfiler(self.device())
        self._profiler.start()

    def stop_profile(self, folder: str, step: int) -> dict:
        """Stop and write this rank's summary and trace into `folder`; returns the summary."""
        profiler, self._profiler = self._profiler, None
        return profiler.stop(folder, step, self.rank)

    def shutdown(self) -> None:
        from pixelrl.parallel.group import destroy_process_group

        if self.world_size > 1:
            destroy_process_group()


class PolicyWorker(RankProcess):
    def __init__(self, cfg_yaml: str, rank: int = 0, world_size: int = 1, num_threads: int | None = None,
                 role: str = "actor"):
        super().__init__(cfg_yaml, rank, world_size, num_threads)
        self.role = role  # actor (trains) | rollout (samples with weights it is sent)
        self.engine = None

    def setup(self, master: tuple[str, int] | None = None) -> dict:
        from pixelrl.engine import PolicyEngine
        from pixelrl.parallel.group import Mesh

        cfg = self._join(master)
        self.engine = PolicyEngine.from_config(cfg, trains=self.role == "actor",
                                               mesh=Mesh(self.world_size, self.rank, cfg.trainer.strategy,
                                                         # a rollout worker samples whole sequences alone
                                                         cfg.trainer.sequence_parallel_size if self.world_size > 1 else 1))
        return {"rank": self.rank, "pid": os.getpid(), "trainable": len(self.engine.trainable_names())}

    # --- the engine's verbs, with numpy transport -------------------------------------
    def rollout(self, request: dict, window, settings=None, num_steps=None, policy="current") -> dict:
        """Sample the request's (prompt, seed[, noise seed]) rows; see `rollout_options`."""
        from pixelrl.sampling.rollout import SamplingSettings
        from pixelrl.sampling.windows import Window

        request = Batch.from_numpy(request)
        started = time.time()
        with naming_the_phase("sampling"):
            batch = self.engine.rollout(request["prompts"], request["seeds"],
                                        window=Window(*window) if window is not None else None,
                                        settings=SamplingSettings(**settings) if settings else None,
                                        num_steps=num_steps, noise_seeds=request.get("noise_seeds"), policy=policy,
                                        condition_images=request.get("condition_images"))
        batch.info.update(gen_start=started, gen_end=time.time())  # wall clock, for timelines
        return batch.to_numpy()

    def score(self, payload: dict, policy: str, values: dict | None = None) -> dict:
        """`values`: per-row values to attach first (a sampled shard's data_sources, which choose
        each row's distillation teacher and which the sampler's answer does not carry)."""
        batch = Batch.from_numpy(payload)
        if values:
            batch.update(Batch(values=values))
        with naming_the_phase("scoring"):
            return self.engine.score(batch, policy).to_numpy()

    def encode(self, payload: dict) -> dict:
        with naming_the_phase("encoding"):
            return self.engine.encode(Batch.from_numpy(payload)).to_numpy()

    def update(self, payload: dict) -> dict:
        with naming_the_phase("update"):
            return self.engine.update(Batch.from_numpy(payload))

    def train_role(self, payload: dict, role: str) -> dict:
        with naming_the_phase(f"update of {role}"):
            return self.engine.train_role(role, Batch.from_numpy(payload))

    def device(self):
        return self.engine.model.device

    def weights(self) -> dict:
        """The trained weights (numpy) and their version; every rank must join (FSDP gathers)."""
        return {"version": self.engine.policy_version,
                "state": {k: v.numpy() for k, v in self.engine.weights().items()}}

    def load_weights(self, payload: dict) -> int:
        import torch

        self.engine.load_weights({k: torch.from_numpy(np.array(v, copy=True)) for k, v in payload["state"].items()},
                                 payload["version"])
        return self.engine.policy_version

    def trainable_state(self) -> dict:
        """This rank's full (unsharded) trainable weights as numpy arrays (to check ranks agree),
        with their EMA under `ema/<name>` when the engine keeps one."""
        from pixelrl.parallel.state import full_tensor, full_trainable_state

        names = self.engine.trainable_names()
        state = {k: v.numpy() for k, v in full_trainable_state(self.engine.model.transformer, names).items()}
        if self.engine.weights_ema is not None:
            state.update({f"ema/{n}": full_tensor(v).numpy() for n, v in zip(names, self.engine.weights_ema.values)})
        return state

    def fsdp_units(self) -> list[str]:
        """Class names of this rank's FSDP2 units (empty under DDP or in one process)."""
        from pixelrl.parallel.fsdp import fsdp_unit_names

        return fsdp_unit_names(self.engine.model.transformer)

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
