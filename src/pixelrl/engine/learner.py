"""`Learner`: the optimizer side of training, shared by RL updates and pretraining.

It owns AdamW, the warm-up schedule, gradient synchronisation (a hook set by DDP), grad-norm
clipping and the non-finite policy: an optimizer step whose accumulated loss or gradient norm
is not finite is skipped and counted, and too many in a row stop the run. Callers accumulate
gradients with their own backward passes and call `step` once per optimizer step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


LR_SCHEDULES = ("constant", "cosine")



def kept_on_device(value):
    """A loss or metric to accumulate where it is, in float64 (so the sums are the ones Python
    floats gave): reading it back inside a micro-batch loop would make the host wait for each
    micro-batch's kernels before launching the next. Plain numbers pass through."""
    return value.detach().double() if torch.is_tensor(value) else value


PREFLIGHT_ZERO_RETRIES = 3  # updates a preflight waits for a gradient that is not all zero


class Learner:
    def __init__(self, params_fn: Callable[[], list[torch.nn.Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, eps: float = 1e-8,
                 warmup_steps: int = 0, max_grad_norm: float = 1.0, max_consecutive_nonfinite: int = 3,
                 schedule: str = "constant", total_steps: int = 0, min_lr_ratio: float = 0.0,
                 preflight_every: int = 0):
        # `params_fn` returns the trainable parameters as they are now: FSDP2 replaces them with
        # sharded DTensors, after which `rebuild()` builds the optimizer over the new ones.
        self.params_fn = params_fn
        self.lr, self.betas, self.weight_decay, self.eps = lr, tuple(betas), weight_decay, eps
        self.warmup_steps = max(int(warmup_steps), 0)
        if schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {LR_SCHEDULES}")
        if schedule == "cosine" and total_steps <= self.warmup_steps:
            raise ValueError(f"a cosine schedule needs total_steps ({total_steps}) > warmup_steps ({self.warmup_steps})")
        self.schedule, self.total_steps, self.min_lr_ratio = schedule, int(total_steps), float(min_lr_ratio)
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.nonfinite_in_a_row = 0
        # the optimizer preflight (engine/preflight.py) after the first step and every this many
        self.preflight_every = int(preflight_every)
        # a first gradient of exactly zero is put off to the next steps (at most this many): a
        # DMD2 student's first update has none by construction (its fake score starts equal to
        # the real one), where a loss that never reaches the weights stays at zero
        self.preflight_retries, self.preflight_pending = PREFLIGHT_ZERO_RETRIES, False
        # Called with the parameters after the backward passes of an optimizer step, before
        # clipping (the DDP all-reduce); None in one process and under FSDP2.
        self.grad_sync: Callable | None = None
        self.rebuild()

    @classmethod
    def from_actor_config(cls, params_fn, acfg, total_steps: int = 0) -> "Learner":
        """`total_steps`: the optimizer steps of the whole run (what a cosine schedule decays over)."""
        return cls(params_fn, lr=acfg.lr, betas=tuple(acfg.betas), weight_decay=acfg.weight_decay,
                   eps=acfg.adam_eps, warmup_steps=acfg.warmup_steps_of(total_steps), max_grad_norm=acfg.max_grad_norm,
                   max_consecutive_nonfinite=acfg.max_consecutive_nonfinite, schedule=acfg.lr_schedule,
                   total_steps=total_steps, min_lr_ratio=acfg.min_lr_ratio, preflight_every=acfg.preflight_every)

    def lr_factor(self, step: int) -> float:
        """The multiplier of `lr` at optimizer step `step` (0-based): linear warm-up, then constant
        or a half cosine from 1 down to `min_lr_ratio` at `total_steps` (verl's cosine schedule)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def rebuild(self) -> None:
        """(Re)create AdamW and its schedule over the current trainable parameters."""
        self.params = list(self.params_fn())
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas,
                                           weight_decay=self.weight_decay, eps=self.eps)
        # a plain function: LambdaLR saves the state of callable objects (and bound methods) in its state_dict
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: self.lr_factor(step))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def current_lr(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def step(self, loss_total: float) -> dict[str, float]:
        """Sync, clip and apply the accumulated gradients. Returns the step's metrics; the
        `stepped` entry is 1.0 when the weights changed, 0.0 when the step was skipped."""
        if self.grad_sync is not None:
            self.grad_sync(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm is a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        if not (math.isfinite(loss_total) and torch.isfinite(grad_norm)):
            # Skip the step rather than poison the weights; too many in a row stops the run.
            self.zero_grad()
            self.nonfinite_in_a_row += 1
            if 0 < self.max_consecutive_nonfinite <= self.nonfinite_in_a_row:
                raise FloatingPointError(
                    f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
                    f"(loss={loss_total}); lower actor.lr or check the reward scale"
                )
            return {"stepped": 0.0, "skipped_nonfinite": 1.0}
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.lr_scheduler.step()
        out = {"stepped": 1.0, "skipped_nonfinite": 0.0, "grad_norm": float(grad_norm)}
        steps = self.lr_scheduler.last_epoch  # this one included
        if steps == 1 or self.preflight_pending or (self.preflight_every and steps % self.preflight_every == 0):
            from pixelrl.engine.preflight import measure

            self.preflight_pending = out["grad_norm"] == 0.0 and self.preflight_retries > 0
            if self.preflight_pending:
                self.preflight_retries -= 1
            else:
                out.update(measure(self.params, self.optimizer, min(out["grad_norm"], self.max_grad_norm), self.eps))
        self.zero_grad()
        self._check_weights_finite()
        return out

    def _check_weights_finite(self) -> None:
        """A finite gradient can still give non-finite weights (an infinite learning rate, eps = 0
        with a zero second moment): stop before anything saves or exports them."""
        # one read of a flag on the weights' device, not one per parameter (hundreds of LoRA
        # matrices); there, too, NCCL can reduce it. The largest |weight| is NaN or inf exactly
        # when some weight is, and on a GPU torch takes it over all tensors in a few launches
        # (foreach), where a test per tensor costs several launches each. Under FSDP2 each rank
        # checks its own shard, which can be empty (a small tensor split over more ranks than it
        # has rows) and has no largest value then
        local = [t for t in ((p.to_local() if hasattr(p, "to_local") else p).detach() for p in self.params) if t.numel()]
        bad = (~torch.isfinite(torch.nn.utils.get_total_norm(local, float("inf")))).float()
        if hasattr(self.params[0], "to_local") and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad)  # shards differ: every rank must stop together
        if bad.item() > 0:
            raise FloatingPointError(
                f"the weights are not finite after optimizer step {self.lr_scheduler.last_epoch} "
                f"(actor.lr={self.lr}, actor.adam_eps={self.eps}): the run stops here, before a checkpoint; "
                "lower actor.lr or raise actor.adam_eps")
