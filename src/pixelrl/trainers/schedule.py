"""When a training loop validates, saves, dumps rollouts, draws a sample grid and stops: each rule
decided here once, for every trainer (the diffusion controller and the VLM trainer)."""

from __future__ import annotations

from pixelrl.config.sections import RunConfig


def every(freq: int, step: int, last: int | bool) -> bool:
    """freq > 0: every freq steps and at the last; 0: only at the last; -1: never. `last` is the
    last step's number, or whether this step is the last."""
    if freq < 0:
        return False
    is_last = last if isinstance(last, bool) else step == last
    return is_last or (freq > 0 and step % freq == 0)


def validation_or_error(validate) -> tuple[dict, Exception | None]:
    """A validation's metrics, or the error it raised: the loop saves the step before raising it
    (`Schedule.saves`), so a validation that fails never costs the trained steps."""
    try:
        return validate(), None
    except Exception as err:
        return {}, err


class Schedule:
    """`trainer.*`'s timing rules for one run of steps `..total`. Call `finish_step` once per step
    with its seconds; it says whether the step is the last (the final step, or
    `trainer.time_budget_s` of summed step time used)."""

    def __init__(self, trainer: RunConfig, total: int):
        self.t, self.total = trainer, total
        self.train_seconds = 0.0  # summed step time of this process
        self.out_of_time = False

    def finish_step(self, step: int, seconds: float) -> bool:
        self.train_seconds += seconds
        self.out_of_time = 0 < self.t.time_budget_s <= self.train_seconds
        return step == self.total or self.out_of_time

    def validates(self, step: int, last: bool) -> bool:
        return every(self.t.test_freq, step, last)

    def saves(self, step: int, last: bool, new_best: bool, val_error: Exception | None, stops: bool = False) -> bool:
        """On the schedule, at a new best validation, and before a failed validation's error or a
        stop (trainer.stop_when_hacking) ends the run (unless saving is off, save_freq -1)."""
        ends = val_error is not None or stops
        return every(self.t.save_freq, step, last) or new_best or (ends and self.t.save_freq != -1)

    def dumps_rollouts(self, has_batch: bool) -> bool:
        return bool(self.t.rollout_data_dir) and has_batch

    def draws_grid(self, step: int, has_batch: bool) -> bool:
        return bool(self.t.log_image_grid_every) and step % self.t.log_image_grid_every == 0 and has_batch
