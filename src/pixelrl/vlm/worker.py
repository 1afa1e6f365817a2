"""`VLMWorker`: one rank of the vision-language actor group. Wraps a VLMEngine.

The same class runs in-process (`trainer.backend=local`, one rank) or as a Ray actor. Each rank
draws its own share of a step's questions from the task (nothing but step numbers crosses the
wire), samples and scores them, and trains with the others (DDP all-reduce or FSDP2 shards).
GRPO groups never straddle ranks: a question's n answers are sampled on one rank.
"""

from __future__ import annotations

import contextlib
import os

from pixelrl.workers.policy_worker import RankProcess


class VLMWorker(RankProcess):
    def __init__(self, cfg_yaml: str, rank: int = 0, world_size: int = 1, num_threads: int | None = None,
                 role: str = "actor"):
        if role != "actor":
            raise ValueError("the vision-language trainer has no separate rollout workers")
        super().__init__(cfg_yaml, rank, world_size, num_threads)
        self.engine = None

    def setup(self, master: tuple[str, int] | None = None) -> dict:
        from pixelrl.vlm.engine import VLMEngine

        self.cfg = self._join(master)
        self.engine = VLMEngine(self.cfg)
        if self.world_size > 1:
            from pixelrl.parallel.group import Mesh

            self.engine.enable_data_parallel(Mesh(self.world_size, self.rank, self.cfg.trainer.strategy))
        return {"rank": self.rank, "pid": os.getpid()}

    def _my_items(self, split: str, start: int, count: int) -> list:
        """This rank's equal share of items `start .. start + count - 1` of `split`, drawn alone:
        items are a pure function of their index, so no rank renders or decodes another's."""
        from pixelrl.vlm.qa_tasks import task_items

        per_rank = count // self.world_size
        return task_items(self.cfg, split, start + self.rank * per_rank, per_rank)

    def train_step(self, step: int) -> dict:
        """Sample, score and train on this rank's share of step `step`'s questions; the metrics."""
        import time

        from torch.profiler import record_function

        from pixelrl.engine.flops import peak_memory_gb
        from pixelrl.engine.profiling import PHASE_PREFIX

        began = time.perf_counter()
        size, rounds = self.cfg.data.train_batch_size, self.cfg.vlm.dynamic_sampling_rounds
        # with dynamic sampling each step owns `rounds` blocks of questions, round k the k-th: a
        # pure function of the step, so a resumed run samples what an uninterrupted one did
        block = lambda k: self._my_items("train", ((step - 1) * max(rounds, 1) + k) * size, size)  # noqa: E731
        with record_function(PHASE_PREFIX + "experience"):  # trainer.profile_step's phases
            exp, metrics = self.engine.make_experience(block(0), step, more_items=block)
        metrics["timing_s/experience"] = time.perf_counter() - began
        mid = time.perf_counter()
        with record_function(PHASE_PREFIX + "update"):
            metrics.update(self.engine.train_on(exp, step))
        metrics["timing_s/train"] = time.perf_counter() - mid
        # per worker (per device), as verl reports them; the controller averages over workers
        seconds = metrics["timing_s/experience"] + metrics["timing_s/train"]
        metrics["perf/throughput"] = len(exp) / seconds  # sampled responses per second
        metrics["perf/tokens_per_s"] = metrics["response/sequence_tokens"] / seconds  # prompt + response
        metrics["perf/peak_memory_gb"] = peak_memory_gb(self.device())
        return metrics

    def device(self):
        return next(self.engine.policy.model.parameters()).device

    def validate(self) -> list[tuple[str, float]]:
        """(question type, correct) for this rank's share of the held-out questions."""
        from pixelrl.vlm.pretrain import answer_correctness

        items = self._my_items("test", 0, self.cfg.vlm.val_items)
        with self.engine.ema_weights() if self.cfg.vlm.validate_ema else contextlib.nullcontext():
            return answer_correctness(self.engine.policy, items, max_new_tokens=self.cfg.vlm.max_new_tokens,
                                      extract=validation_extract(self.cfg))

    def trainable_state(self) -> dict:
        """This rank's full trainable weights (and critic) as numpy arrays, to check ranks agree."""
        from pixelrl.parallel.state import full_tensor

        engine = self.engine
        state = {f"actor/{n}": full_tensor(p).numpy() for n, p in zip(engine._trainable_names(), engine.trainable)}
        if engine.critic is not None:
            state.update({f"critic/{n}": full_tensor(p).numpy() for n, p in engine.critic.named_parameters()})
        return state

    def fsdp_units(self) -> dict[str, list[str]]:
        """Class names of this rank's FSDP2 units, for the actor and the critic (empty under DDP)."""
        from pixelrl.parallel.fsdp import fsdp_unit_names

        engine = self.engine
        return {"actor": fsdp_unit_names(engine.policy.model),
                "critic": fsdp_unit_names(engine.critic) if engine.critic is not None else []}

    def save(self, folder: str) -> None:
        self.engine.save(folder, write=self.rank == 0)

    def load(self, folder: str) -> dict:
        self.engine.load(folder)
        return {"rank": self.rank}


def validation_extract(cfg) -> str:
    """Validation reads the answer out of a response as the run's `answer_match` reward does (its
    `extract` option), so held-out accuracy and the training reward judge the same thing."""
    for spec in cfg.reward.functions:
        if spec.get("name") == "answer_match":
            return (spec.get("options") or {}).get("extract", "whole")
    return "whole"
