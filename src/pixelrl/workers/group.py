"""Worker groups: the driver's handle on N actor workers (Ray, or one in-process worker) and on
the reward workers. A group exposes the engine's verbs on whole batches: it shards, calls every
worker, and gathers. A dead worker is reported by rank with Ray's reason, and a worker killed by a
signal (a native crash, the OOM killer) also with what its log on this machine says about it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from pixelrl.core.batch import Batch
from pixelrl.core.errors import PixelRLError
from pixelrl.workers.local_ray import start_local_ray
from pixelrl.workers.policy_worker import PolicyWorker
from pixelrl.workers.reward_worker import RewardWorker


class WorkerDiedError(PixelRLError, RuntimeError):
    """A worker failed. `process_died`: its process is gone (a signal, the OOM killer, a lost node),
    as opposed to an exception it raised; only such a failure is worth a restart."""

    def __init__(self, message: str, process_died: bool = False):
        super().__init__(message)
        self.process_died = process_died


# what a process that dies of a signal leaves in its stderr: the signal handlers' reports of Ray
# (absl) and Python (faulthandler), glibc's heap checks, a C++ terminate
_LAST_WORDS = re.compile(r"\*\*\* SIG[A-Z]+ received|PC: @|Fatal Python error|^malloc\(\)|^free\(\)|"
                         r"^double free|^corrupted |terminate called")
_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # Ray's "[time E pid tid] file.cc:line: " prefix


def _dead_pid(ray_message: str) -> str | None:
    """The process id in Ray's message about an actor whose process died (`pid: N`)."""
    found = re.search(r"\bpid: (\d+)", ray_message)
    return found.group(1) if found else None


def native_crash_report(pid: str | None, max_lines: int = 4) -> str:
    """For a Ray actor (process `pid`) that died without a Python exception: its log file under
    this machine's Ray session and the signal lines it ends with, or "" when the log is not here
    (another node) or says nothing of a signal (a SIGKILL, as from the OOM killer, leaves no report)."""
    if pid is None:
        return ""
    try:
        import ray._private.worker as ray_worker  # the session's folder is not public API

        logs = Path(ray_worker._global_node.get_logs_dir_path())
    except Exception:
        return ""
    files = sorted(logs.glob(f"worker-*-{pid}.err"))
    if not files:
        return ""
    lines = crash_lines(files[-1].read_text(errors="replace"))
    return f" Its log {files[-1]} says: {' | '.join(lines[:max_lines])}" if lines else ""


def crash_lines(log: str) -> list[str]:
    """The lines of a worker's stderr that report how it died, each once (Ray prints its signal
    report twice, once with its logging prefix)."""
    seen: list[str] = []
    for line in log.splitlines():
        line = _LOG_PREFIX.sub("", line.strip())
        if _LAST_WORDS.search(line) and line not in seen:
            seen.append(line)
    return seen


def _shards(n: int, parts: int) -> list[slice]:
    size = n // parts
    if size * parts != n:
        raise ValueError(f"{n} samples do not split evenly over {parts} workers")
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


GATHERS = ("batch", "mean", "first", "all")


class Pending:
    """A group call in flight: `result()` waits for every worker and gathers their answers."""

    def __init__(self, group: "_Group", handles: list, gather: str):
        self.group, self.handles, self.gather = group, handles, gather

    @property
    def row_handles(self) -> list:
        """The answers that hold distinct rows, in row order: one per sequence group (its ranks
        answer for the same rows alike)."""
        return self.handles[::self.group.sequence_size]

    def result(self):
        results = self.group._wait(self.handles)
        if self.gather == "batch":
            parts = [Batch.from_numpy(r) for r in results[::self.group.sequence_size]]
            merged = Batch.concat(parts)
            # each worker stamps its own sampling; the group's runs from the first start to the last end
            for key, pick in (("gen_start", min), ("gen_end", max)):
                if all(key in p.info for p in parts):
                    merged.info[key] = pick(p.info[key] for p in parts)
            return merged
        if self.gather == "mean":  # metrics dicts: the mean over ranks
            return {k: float(np.mean([m[k] for m in results])) for k in results[0]}
        return results[0] if self.gather == "first" else results


class _Group:
    """One generic call for every verb; subclasses say how to start a method on every worker
    (`_launch`) and how to wait for the answers (`_wait`)."""

    size: int
    sequence_size: int = 1  # consecutive ranks that hold the same rows (trainer.sequence_parallel_size)

    @property
    def data_size(self) -> int:
        """Workers holding different rows: what a batch must split evenly over."""
        return self.size // self.sequence_size

    def _row_shards(self, n: int) -> list[slice]:
        """Each worker's rows: the data ranks split them; the ranks of a sequence group share theirs."""
        return [part for part in _shards(n, self.data_size) for _ in range(self.sequence_size)]

    def _launch(self, method: str, per_worker_args: list[tuple]) -> list:
        raise NotImplementedError

    def _wait(self, handles: list) -> list:
        raise NotImplementedError

    def submit(self, verb: str, batch: Batch | None = None, *args, gather: str = "batch") -> Pending:
        """Start `verb` on every worker: with a `batch`, each worker gets its equal shard (as
        numpy) followed by `args`; without, every worker gets `args`. Returns at once on Ray."""
        if gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
        if batch is None:
            per_worker = [args] * self.size
        else:
            per_worker = [(batch.select(range(s.start, s.stop)).to_numpy(), *args)
                          for s in self._row_shards(len(batch))]
        return Pending(self, self._launch(verb, per_worker), gather)

    def submit_on_answers(self, verb: str, pending: Pending, *args, rows: dict | None = None) -> Pending:
        """Start `verb` on every worker with its own answer to `pending` (a batch call of this group
        still in flight) followed by `args` and that shard's part of `rows` (per-row values of the
        batch `pending` was given). On Ray the answers stay in the object store: each worker starts
        once its own is ready, and the driver waits for nothing."""
        parts = [None] * self.size
        if rows:
            count = len(next(iter(rows.values())))
            parts = [{key: list(values[s]) for key, values in rows.items()} for s in self._row_shards(count)]
        return Pending(self, self._launch(verb, [(answer, *args, part) for answer, part in zip(pending.handles, parts)]),
                       "batch")

    def call(self, verb: str, batch: Batch | None = None, *args, gather: str = "batch"):
        """`submit` and wait."""
        return self.submit(verb, batch, *args, gather=gather).result()

    # The engine's verbs under their own names, so a step runs on a group or on an engine alike.
    def rollout(self, prompts, seeds, *, window=None, settings=None, num_steps=None, noise_seeds=None,
                policy="current", condition_images=None) -> Batch:
        return self.call("rollout", rollout_request(prompts, seeds, noise_seeds, condition_images), *rollout_options(
            window, settings, num_steps, policy))

    def score(self, batch: Batch, policy: str) -> Batch:
        return self.call("score", batch, policy)

    def encode(self, batch: Batch) -> Batch:
        return self.call("encode", batch)

    def update(self, batch: Batch) -> dict[str, float]:
        return self.call("update", batch, gather="mean")

    def trainable_states(self) -> list[dict]:
        """Every rank's full trainable weights (numpy), in rank order."""
        return self.call("trainable_state", gather="all")

    def save(self, folder: str) -> None:
        self.call("save", None, folder, gather="all")

    def load(self, folder: str) -> dict:
        return self.call("load", None, folder, gather="first")


def rollout_request(prompts, seeds, noise_seeds=None, condition_images=None) -> Batch:
    values = {"prompts": list(prompts), "seeds": list(seeds)}
    if noise_seeds is not None:
        values["noise_seeds"] = list(noise_seeds)
    if condition_images is not None:
        values["condition_images"] = list(condition_images)
    return Batch(values=values)


def rollout_options(window=None, settings=None, num_steps=None, policy="current") -> tuple:
    """The rollout verb's arguments after the request, as plain data for transport."""
    return ((window.start, window.end) if window is not None else None,
            settings.as_dict() if settings is not None else None, num_steps, policy)


def check_cluster_answers(address: str, timeout_s: float = 10.0) -> None:
    """A `host:port` cluster address must accept a connection within `timeout_s`: ray.init would
    otherwise retry a wrong address for minutes without a word."""
    import socket

    from pixelrl.core.errors import ConfigError

    if address == "auto" or "://" in address or ":" not in address:
        return  # Ray resolves these itself
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError("trainer.ray_address", address, "a cluster address is host:port (the head node's GCS "
                          "port, 6379 by default), auto, or empty for a local cluster")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError("trainer.ray_address", address, f"no Ray cluster answers there ({err}): start one with "
                          "`ray start --head`, fix the address, or leave trainer.ray_address and $RAY_ADDRESS "
                          "empty for a local cluster") from None


def ensure_ray(trainer_cfg, extra_cpus: int = 0) -> bool:
    """Join the Ray cluster named by trainer.ray_address or $RAY_ADDRESS, or start a local one
    with enough CPUs for the actor workers (and `extra_cpus`). True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = trainer_cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:  # the user's cluster, as it is configured (docs/runtime.md: its exposure is theirs to choose)
        check_cluster_answers(address)
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    else:
        start_local_ray(max(os.cpu_count() or 1, trainer_cfg.n_workers * trainer_cfg.num_cpus_per_worker + extra_cpus))
    return True


class LocalWorkerGroup(_Group):
    """In-process workers, no Ray: one actor (no process group), or `size` independent rollout
    workers. Calls run when submitted, in order. For debugging and fast tests."""

    def __init__(self, cfg_yaml: str, role: str = "actor", size: int = 1, worker_cls=PolicyWorker):
        if role == "actor" and size != 1:
            raise ValueError("an in-process actor group has one worker (use Ray for data parallelism)")
        self.size = size
        self.workers = [worker_cls(cfg_yaml, rank, 1, role=role) for rank in range(size)]
        for worker in self.workers:
            worker.setup()

    def _launch(self, method, per_worker_args):
        return [getattr(w, method)(*args) for w, args in zip(self.workers, per_worker_args)]

    def _wait(self, handles):
        return handles

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


class RayWorkerGroup(_Group):
    """N Ray actors in a placement group: actors form one torch.distributed group; rollout
    workers (`role="rollout"`) are independent samplers."""

    FAILURE_GRACE_S = 10.0  # after a first failure, how long the other ranks get to report theirs

    def __init__(self, cfg_yaml: str, n_workers: int, num_cpus: int, num_gpus: int = 0, role: str = "actor",
                 worker_cls=PolicyWorker, sequence_size: int = 1):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.size, self.sequence_size = n_workers, sequence_size
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.placement = placement_group([bundle] * n_workers, strategy="PACK")
        ray.get(self.placement.ready())
        actor_cls = ray.remote(worker_cls)
        self.workers = [
            actor_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                                     placement_group_bundle_index=rank),
            ).remote(cfg_yaml, rank, n_workers if role == "actor" else 1, num_cpus, role)
            for rank in range(n_workers)
        ]
        self.role = role
        try:
            master = self._wait([self.workers[0].address.remote()])[0] if role == "actor" else None
            self._wait([w.setup.remote(master) for w in self.workers])
        except BaseException:
            self.shutdown()  # release the actors and their reserved resources before reporting
            raise

    def _wait(self, refs: list) -> list:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(refs)
        except (RayActorError, RayTaskError) as err:
            # a rank that dies breaks its peers' collectives, and their exceptions can reach the
            # driver before Ray has noticed the death: give every rank a moment to report
            ray.wait(refs, num_returns=len(refs), timeout=self.FAILURE_GRACE_S)
            failures = []
            for rank, ref in enumerate(refs):
                if ray.wait([ref], timeout=0)[0]:
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError) as worker_err:
                        failures.append((rank, worker_err))
            if not failures:
                raise WorkerDiedError(f"a {self.role} worker failed: {err}") from err
            # the cause first: bad input a worker named, then a process that died, then an exception
            def likeliest_cause(failure):
                rank, worker_err = failure
                named = isinstance(getattr(worker_err, "cause", None), PixelRLError)
                return 0 if named else 1 if isinstance(worker_err, RayActorError) else 2, rank

            rank, worker_err = min(failures, key=likeliest_cause)
            cause = getattr(worker_err, "cause", None)
            if isinstance(cause, PixelRLError):  # bad input found by a worker: its message, no trace
                raise WorkerDiedError(f"{self.role} worker rank {rank}: {cause}") from err
            reason = str(worker_err).strip().splitlines()
            pid = _dead_pid(str(worker_err))
            raise WorkerDiedError(f"{self.role} worker rank {rank}{f' (pid {pid})' if pid else ''} failed: "
                                  f"{' '.join(reason[-3:])}{native_crash_report(pid)}",
                                  process_died=isinstance(worker_err, RayActorError)) from err

    def _launch(self, method, per_worker_args):
        return [getattr(w, method).remote(*args) for w, args in zip(self.workers, per_worker_args)]

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
    `pool` workers reserve `num_cpus` (and `num_gpus`) each, so a heavy reward model gets its own resources.
    """

    def __init__(self, functions: list[dict], *, backend: str, placement: str = "colocated",
                 num_workers: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0, plugins: tuple = (),
                 timeout_s: float = 0.0):
        from pixelrl.rewards.groupwise import is_groupwise

        self.local = None
        self.workers = []
        # a group-wise reward compares the images of a prompt: its calls must hold whole groups,
        # so the batch goes to one worker in one piece
        self.whole_batches = is_groupwise(functions)
        if backend == "local":
            self.local = RewardWorker(functions, plugins=plugins, timeout_s=timeout_s)
            self.local.setup()
            return
        import ray

        reserve = 0 if placement == "colocated" else num_cpus
        threads = max(1, int(num_cpus)) if placement == "pool" else 1
        actor_cls = ray.remote(RewardWorker)
        gpus = num_gpus if placement == "pool" else 0  # a reward on a GPU sees only its own (CUDA_VISIBLE_DEVICES)
        options = dict(num_cpus=reserve, num_gpus=gpus)
        if not gpus:
            # recent Ray leaves CUDA_VISIBLE_DEVICES alone for an actor without GPUs: a
            # colocated reward worker would see every GPU of the node and load its model onto the
            # first, beside a policy worker that the memory plan gave that whole card
            options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
        self.workers = [actor_cls.options(**options).remote(functions, threads, plugins, timeout_s)
                        for _ in range(num_workers)]
        ray.get([w.setup.remote() for w in self.workers])

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 condition_images: list | None = None, groups: list | None = None) -> dict[str, torch.Tensor]:
        """Every image's scores; `groups` (each image's row uid) reaches a group-wise reward."""
        array = images.numpy()
        if self.local is not None:
            parts = [self.local.score(array, prompts, metadata, condition_images, groups)]
        else:
            chunks = np.array_split(np.arange(len(prompts)), 1 if self.whole_batches else len(self.workers))
            refs = [w.score.remote(array[c], [prompts[i] for i in c], [metadata[i] for i in c],
                                   None if condition_images is None else [condition_images[i] for i in c],
                                   None if groups is None else [groups[i] for i in c])
                    for w, c in zip(self.workers, chunks) if len(c)]
            parts = _scores(refs)
        return {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]}

    def submit(self, rollout: Pending, metadata: list[dict], groups: list | None = None) -> list:
        """Score a rollout still in flight. On Ray each rollout shard goes to a reward worker as
        an object reference: scoring starts when that shard is sampled, and neither the driver
        nor the rollout pool waits for it. In one process, scores now. `groups` (each image's
        row uid) reaches a group-wise reward, which scores the whole rollout in one call."""
        if self.local is not None:
            batch = rollout.result()
            return [self.local.score_rollout(metadata, batch.to_numpy(), groups=groups)]
        if self.whole_batches:
            return [self.workers[0].score_rollout.remote(metadata, *rollout.row_handles, groups=groups)]
        parts = _shards(len(metadata), len(rollout.row_handles))
        return [self.workers[i % len(self.workers)].score_rollout.remote(metadata[part], ref)
                for i, (ref, part) in enumerate(zip(rollout.row_handles, parts))]

    def collect(self, handles: list) -> tuple[dict[str, torch.Tensor], float, float]:
        """The scores of `submit`, and when scoring started and ended (wall clock)."""
        parts = handles if self.local is not None else _scores(handles)
        scores = {k: torch.from_numpy(np.concatenate([p["scores"][k] for p in parts])) for k in parts[0]["scores"]}
        return scores, min(p["start"] for p in parts), max(p["end"] for p in parts)

    def shutdown(self) -> None:
        if self.workers:
            import ray

            for w in self.workers:
                ray.kill(w)


def _scores(refs: list) -> list:
    """ray.get of reward workers' answers; a reward's own error (RewardError: raised, timed out,
    non-finite) arrives as itself, so the trainer's reward.on_error sees it and its message."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(refs)
    except RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, PixelRLError):
            raise cause from None
        raise
