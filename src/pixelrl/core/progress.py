"""Progress as people read it: `i/N, elapsed, eta` lines for long loops (training steps, images
generated), on a terminal and in a log alike."""

from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """`i/N, elapsed, eta`: the ETA is the mean time of the units done since this object was made
    (`first_done` of them were done before: a resumed run) times the units left, or what is left
    of `budget_s` (a run's trainer.time_budget_s, counted from this object's start) where that
    ends the run sooner."""

    def __init__(self, total: int, first_done: int = 0, clock=time.monotonic, budget_s: float = 0.0):
        self.total, self.done_before, self.clock, self.budget_s = int(total), int(first_done), clock, float(budget_s)
        self.start = clock()

    def line(self, done: int) -> str:
        since = done - self.done_before
        if since <= 0:
            return ""
        elapsed = self.clock() - self.start
        eta, ends = elapsed / since * max(0, self.total - done), ""
        if self.budget_s > 0 and self.budget_s - elapsed < eta:
            eta, ends = max(0.0, self.budget_s - elapsed), " (time budget)"
        return f"{done}/{self.total}, {duration(elapsed)}, eta {duration(eta)}{ends}"


def report_progress(what: str, progress: Progress, done: int, stream=None) -> None:
    """One plain line on stderr (a terminal and a log file read the same)."""
    print(f"{what}: {progress.line(done)}", file=stream or sys.stderr, flush=True)
