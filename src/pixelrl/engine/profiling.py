"""`trainer.profile_step`: one training step under torch.profiler on every actor worker, and a
summary of where its time went.

Each worker writes, into `<run>/profile/`, `step_<N>_rank_<R>.txt` (the summary) and then
`step_<N>_rank_<R>.json.gz` (a Chrome trace for Perfetto or chrome://tracing). The summary comes
first because a large step's trace takes a while to write and a killed run should still leave the
numbers. It answers the question a low `perf/mfu` raises: is the device idle (waiting on the host:
launches, synchronisation, Python between kernels), or busy in slow work (attention, elementwise
and normalisation kernels, copies), or are the matrix products themselves slow? On a GPU it counts
CUDA kernel time; on the CPU, each aten operator's self time.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType

PHASE_PREFIX = "pixelrl/"  # the record_function label of each worker phase (`memory.naming_the_phase`)

# kernel or operator name fragments (lower case), first match wins
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "scaled_dot_product")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                "aten::_addmm_activation", "matmul")),
    ("communication", ("nccl", "c10d")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
)
OTHER = "elementwise and other"


def category(name: str) -> str:
    lowered = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in lowered for f in fragments):
            return label
    return OTHER


def _work_events(events, on_cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start us, seconds) of each unit of device work: a CUDA kernel or copy on a GPU, an aten
    operator's self time on the CPU (self times partition the time, so nothing counts twice)."""
    work = []
    for e in events:
        if on_cuda and e.device_type == DeviceType.CUDA and not e.is_user_annotation:  # not a label's GPU span
            work.append((e.name, e.time_range.start, e.time_range.elapsed_us() / 1e6))
        elif not on_cuda and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            work.append((e.name, e.time_range.start, e.self_cpu_time_total / 1e6))
    return work


def summarize(events, wall_s: float, on_cuda: bool) -> dict:
    """{"wall_s", "busy_s", "categories": {category: s}, "phases": {phase: {"wall_s", "busy_s"}},
    "top": [(name, s, calls)]}: device work by category and by worker phase (work belongs to the
    phase that last started before it; on a GPU a kernel may run after its phase's host code
    returned), and the 25 costliest kernels or operators."""
    work = _work_events(events, on_cuda)
    phases = sorted((e.time_range.start, e.time_range.end, e.name[len(PHASE_PREFIX):]) for e in events
                    if e.name.startswith(PHASE_PREFIX) and e.device_type == DeviceType.CPU)
    phase_starts = [start for start, _, _ in phases]
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    by_phase: dict[str, dict[str, float]] = {}
    for start, end, name in phases:
        entry = by_phase.setdefault(name, {"wall_s": 0.0, "busy_s": 0.0})
        entry["wall_s"] += (end - start) / 1e6
    for name, start, seconds in work:
        by_category[category(name)] += seconds
        by_name[name][0] += seconds
        by_name[name][1] += 1
        latest = bisect_right(phase_starts, start) - 1  # the phase that last started before it
        owner = phases[latest][2] if latest >= 0 else "outside the phases"
        by_phase.setdefault(owner, {"wall_s": 0.0, "busy_s": 0.0})["busy_s"] += seconds
    outside = by_phase.setdefault("outside the phases", {"wall_s": 0.0, "busy_s": 0.0})
    outside["wall_s"] = max(0.0, wall_s - sum(e["wall_s"] for name, e in by_phase.items() if e is not outside))
    top = sorted(((n, s, c) for n, (s, c) in by_name.items()), key=lambda row: -row[1])[:25]
    return {"wall_s": wall_s, "busy_s": sum(by_category.values()), "categories": dict(by_category),
            "phases": by_phase, "top": top}


def format_summary(summary: dict, step: int, device: str) -> str:
    wall = summary["wall_s"]
    unit = "kernel" if device == "cuda" else "operator self"
    lines = [f"step {step} on {device}: {wall:.3f} s wall, {summary['busy_s']:.3f} s of {unit} time "
             f"({summary['busy_s'] / wall:.0%} busy)", "", f"{unit} time by category:"]
    for name, seconds in sorted(summary["categories"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<24} {seconds:9.3f} s  {seconds / wall:6.1%} of the step")
    lines += ["", f"by worker phase (wall = the phase's host time, the rest of the step outside them; busy = "
              f"{unit} time started in it):"]
    for name, entry in summary["phases"].items():
        lines.append(f"  {name:<24} wall {entry['wall_s']:9.3f} s  busy {entry['busy_s']:9.3f} s")
    lines += ["", "costliest:"]
    for name, seconds, calls in summary["top"]:
        lines.append(f"  {seconds:9.3f} s  {calls:7d} x  {name[:110]}")
    return "\n".join(lines) + "\n"


class StepProfiler:
    """`start()` before a step's first worker call and `stop()` after its last, on one worker."""

    def __init__(self, device: str):
        self.device = torch.device(device).type
        self._profiler = None
        self._started = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def stop(self, folder: str | Path, step: int, rank: int) -> dict:
        """Stop, write the summary and then the trace; returns the summary."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        summary = summarize(profiler.events(), wall, self.device == "cuda")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"step_{step}_rank_{rank}"
        stem.with_suffix(".txt").write_text(format_summary(summary, step, self.device))
        profiler.export_chrome_trace(str(stem) + ".json.gz")
        return summary
