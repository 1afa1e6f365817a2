"""The producer on a separate rollout pool, sampling ahead of the consumer on a fixed schedule.

Batch j is sampled with the weights after training step max(0, j - 1 - k), k = the mode's
staleness (sync 0, one_step_off 1, async `trainer.max_staleness`). At the start of step i the
actor holds the weights after step i - 1: they are sent to the pool (tagged with their version)
and batch i + k is launched with them, so that sampling it overlaps training on batch i. Rewards
are chained to each rollout shard on the reward workers and overlap the next sampling.

Because the schedule never depends on timing, a run is reproducible from its seed, k = 0 equals
the synchronous trainer bitwise, and a checkpoint that stores the batches still queued (steps
i + 1 .. i + k) resumes exactly. Extending a finished run to more steps is the exception: the
batches past its old total are sampled with the newest weights, as no older ones are kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pixelrl.core.batch import Batch
from pixelrl.sampling.windows import Window
from pixelrl.trainers.step import Rollout, finish_rollout, plan_rollout, sampling_policy
from pixelrl.workers.group import Pending, rollout_options


def staleness_of(cfg) -> int:
    return {"sync": 0, "one_step_off": 1, "async": cfg.trainer.max_staleness}[cfg.trainer.mode]


@dataclass
class InFlight:
    step: int
    request: Batch
    window: Window
    generation: Pending
    scoring: list
    weights_step: int
    teacher: Pending | None = None  # the pool's replay of the distillation teacher (rollout.scores_teacher)


class AheadProducer:
    def __init__(self, pool, actor, rewards, cfg, next_rows):
        self.pool, self.actor, self.rewards, self.cfg = pool, actor, rewards, cfg
        self.next_rows = next_rows  # () -> the loader's next batch of rows
        self.staleness = staleness_of(cfg)
        self.queue: dict[int, InFlight | Rollout] = {}
        self.next_launch = 1
        self.synced_step = -1  # the training step whose weights the pool holds
        self._pending_sync: list[Pending] = []

    def start(self, first_step: int, restored: list[Rollout]) -> None:
        """Continue at `first_step` with the batches a checkpoint had queued."""
        expected = list(range(first_step, first_step + len(restored)))
        if [r.step for r in restored] != expected or len(restored) > self.staleness:
            from pixelrl.core.errors import ConfigError

            raise ConfigError("trainer.mode", self.cfg.trainer.mode,
                              f"the checkpoint queued batches for steps {[r.step for r in restored]}, but this mode "
                              f"samples {self.staleness} step(s) ahead: resume with the mode and max_staleness it "
                              "was saved with")
        self.queue = {r.step: r for r in restored}
        self.next_launch = first_step + len(restored)

    def rollout_for(self, step: int, total: int) -> Rollout:
        """Launch what the schedule allows up to step + k, then wait for batch `step`."""
        trained = step - 1
        while self.next_launch <= min(step + self.staleness, total):
            j = self.next_launch
            # The schedule asks for the weights after step max(0, j - 1 - k), which is `trained`
            # except when a finished run is extended (its last checkpoint queued nothing past its
            # old total): then the newest weights are the only ones left, and the batch is fresher
            # than the schedule says (its recorded staleness shows it).
            if self.synced_step != trained:
                self._send_weights()
                self.synced_step = trained
            rows = self.next_rows()
            request, window = plan_rollout(rows["prompts"], rows["metadata"], j, self.cfg,
                                           data_sources=rows["data_sources"],
                                           condition_images=rows.get("condition_images"))
            generation = self.pool.submit("rollout", request, *rollout_options(
                window, policy=sampling_policy(self.cfg)))
            scoring = self.rewards.submit(generation, request["metadata"], request["uids"])
            # the teacher's replay reads only the sampled states, not the actor's weights: on the
            # pool, chained to each worker's own shard, it overlaps the actor's update
            teacher = (self.pool.submit_on_answers("score", generation, "teacher",
                                                   rows={"data_sources": request["data_sources"]}
                                                   if "data_sources" in request else None)
                       if self.cfg.rollout.scores_teacher else None)
            self.queue[j] = InFlight(j, request, window, generation, scoring, trained, teacher)
            self.next_launch += 1
        return self._collect(step)

    def _send_weights(self) -> None:
        # On Ray the pool workers read rank 0's answer from the object store, and the loads queue
        # ahead of the next rollout on each worker; every actor rank answers (FSDP gathers shards).
        weights = self.actor.submit("weights", gather="first")
        load = self.pool.submit("load_weights", None, weights.handles[0], gather="all")
        self._pending_sync += [weights, load]

    def _collect(self, step: int) -> Rollout:
        item = self.queue.pop(step)
        if isinstance(item, Rollout):
            return item
        waited = time.perf_counter()
        batch = item.generation.result()
        if item.teacher is not None:
            batch.update(item.teacher.result())  # teacher_log_probs and teacher_means, row for row
        scores, reward_start, reward_end = self.rewards.collect(item.scoring)
        for pending in self._pending_sync:
            pending.result()  # surface a failed weight sync here
        self._pending_sync.clear()
        waited = time.perf_counter() - waited
        batch.info.update(reward_start=reward_start, reward_end=reward_end)  # beside gen_start / gen_end
        return finish_rollout(step, item.request, item.window, batch, scores, self.cfg,
                              {"wait_rollout": waited}, item.weights_step)

    def queued(self) -> list[Rollout]:
        """Every batch still queued, finished (waits for those in flight); they stay queued."""
        for step in sorted(self.queue):
            self.queue[step] = self._collect(step) if not isinstance(self.queue[step], Rollout) else self.queue[step]
        return [self.queue[s] for s in sorted(self.queue)]
