"""Worker groups: the driver's handle on N actor workers (Ray, or one in-process worker) and on
the reward workers. A group exposes the engine's verbs on whole batches: it shards, calls every
worker, and gathers. A dead worker is reported by rank with Ray's reason."""

from __future__ import annotations

import os

import numpy as np
import torch

from pixelrl.core.batch import Batch
from pixelrl.core.errors import PixelRLError
from pixelrl.workers.policy_worker import PolicyWorker
from pixelrl.workers.reward_worker import RewardWorker


class WorkerDiedError(PixelRLError, RuntimeError):
    pass


def _shards(n: int, parts: int) -> list[slice]:
    size = n // parts
    if size * parts != n:
        raise ValueError(f"{n} samples do not split evenly over {parts} workers")
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


class _Group:
    """Shared sharding logic; subclasses say how to call a method on every worker."""

    size: int

    def _call_all(self, method: str, per_worker_args: list[tuple]) -> list:
        raise NotImplementedError

    def rollout(self, prompts, seeds, *, window=None, settings=None, num_steps=None, noise_seeds=None,
                policy="current") -> Batch:
        win = (window.start, window.end) if window is not None else None
        sett = settings.as_dict() if settings is not None else None
        parts = _shards(len(prompts), self.size)
        results = self._call_all("rollout", [(prompts[s], seeds[s], win, sett, num_steps,
                                              None if noise_seeds is None else noise_seeds[s], policy) for s in parts])
        return Batch.concat([Batch.from_numpy(r) for r in results])

    def _sharded(self, batch: Batch) -> list[dict]:
        return [batch.select(range(s.start, s.stop)).to_numpy() for s in _shards(len(batch), self.size)]

    def score(self, batch: Batch, policy: str) -> Batch:
        return Batch.concat([Batch.from_numpy(r) for r in self._call_all("score", [(p, policy) for p in self._sharded(batch)])])

    def encode(self, batch: Batch) -> Batch:
        return Batch.concat([Batch.from_numpy(r) for r in self._call_all("encode", [(p,) for p in self._sharded(batch)])])

    def update(self, batch: Batch) -> dict[str, float]:
        metrics = self._call_all("update", [(p,) for p in self._sharded(batch)])
        return {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}

    def trainable_states(self) -> list[dict]:
        """Every rank's full trainable weights (numpy), in rank order."""
        return self._call_all("trainable_state", [()] * self.size)

    def save(self, folder: str) -> None:
        self._call_all("save", [(folder,)] * self.size)

    def load(self, folder: str) -> dict:
        return self._call_all("load", [(folder,)] * self.size)[0]


class LocalWorkerGroup(_Group):
    """One in-process worker: no Ray, no process group. For debugging and fast tests."""

    def __init__(self, cfg_yaml: str):
        self.size = 1
        self.worker = PolicyWorker(cfg_yaml)
        self.worker.setup()

    def _call_all(self, method, per_worker_args):
        return [getattr(self.worker, method)(*per_worker_args[0])]

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayWorkerGroup(_Group):
    """N Ray actors in a placement group, forming one torch.distributed group."""

    def __init__(self, cfg_yaml: str, n_workers: int, num_cpus: int, num_gpus: int = 0):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.size = n_workers
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.placement = placement_group([bundle] * n_workers, strategy="PACK")
        ray.get(self.placement.ready())
        actor_cls = ray.remote(PolicyWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                                     placement_group_bundle_index=rank),
            ).remote(cfg_yaml, rank, n_workers, num_cpus)
            for rank in range(n_workers)
        ]
        try:
            master = self._get([self.workers[0].address.remote()])[0]
            self._get([w.setup.remote(master) for w in self.workers])
        except BaseException:
            self.shutdown()  # release the actors and their reserved resources before reporting
            raise

    def _get(self, refs: list) -> list:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(refs)
        except (RayActorError, RayTaskError) as err:
            for rank, ref in enumerate(refs):
                ready, _ = ray.wait([ref], timeout=0)
                if ready:
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError) as worker_err:
                        reason = str(worker_err).strip().splitlines()
                        raise WorkerDiedError(f"actor worker rank {rank} failed: {' '.join(reason[-3:])}") from err
            raise WorkerDiedError(f"an actor worker failed: {err}") from err

    def _call_all(self, method, per_worker_args):
        return self._get([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_worker_args)])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # a dead worker cannot leave the group cleanly; the cluster goes anyway
            pass
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.placement)


class RewardGroup:
    """Reward scoring in-process (local backend) or in Ray reward workers.

    `colocated` workers take no CPU reservation of their own (they share the actors' nodes);
    `pool` workers reserve `num_cpus` each, so a heavy reward model gets its own resources.
    """

    def __init__(self, functions: list[dict], *, backend: str, placement: str = "colocated",
                 num_workers: int = 1, num_cpus: float = 1.0):
        self.local = None
        self.workers = []
        if backend == "local":
            self.local = RewardWorker(functions)
            self.local.setup()
            return
        import ray

        reserve = 0 if placement == "colocated" else num_cpus
        threads = max(1, int(num_cpus)) if placement == "pool" else 1
        actor_cls = ray.remote(RewardWorker)
        self.workers = [actor_cls.options(num_cpus=reserve).remote(functions, threads) for _ in range(num_workers)]
        ray.get([w.setup.remote() for w in self.workers])

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        array = images.numpy()
        if self.local is not None:
            parts = [self.local.score(array, prompts, metadata)]
        else:
            import ray

            chunks = np.array_split(np.arange(len(prompts)), len(self.workers))
            refs = [w.score.remote(array[c], [prompts[i] for i in c], [metadata[i] for i in c])
                    for w, c in zip(self.workers, chunks) if len(c)]
            parts = ray.get(refs)
        return {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]}

    def shutdown(self) -> None:
        if self.workers:
            import ray

            for w in self.workers:
                ray.kill(w)
