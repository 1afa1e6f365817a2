"""Shared by the benchmark scripts: run `pixelrl train` and summarise its per-step metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def mib(gb: float) -> float:
    """A `perf/peak_memory_gb` figure in the MiB the benchmark tables print as "MB"."""
    return gb * 1e9 / 2 ** 20


def peak_rss_mb() -> float:
    """This process's peak resident set in MiB (pixelrl's own measure, which does not inherit
    the parent's resident set as getrusage's ru_maxrss does)."""
    from pixelrl.engine.flops import peak_memory_gb

    return mib(peak_memory_gb("cpu"))


def train_and_measure(config: str | None, model: Path, out: Path, experiment: str, overrides: list[str],
                      warmup: int = 1) -> dict:
    """Run the trainer (`config` None: the default config); return mean seconds per step and per
    phase over all steps but the first `warmup`, the images per step, and the last step's metrics."""
    from pixelrl.cli import main

    name = ["--config-name", config] if config else []
    code = main(["train", *name, f"model.path={model}", f"trainer.default_local_dir={out}",
                 f"trainer.experiment_name={experiment}", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 *overrides])
    if code != 0:
        raise SystemExit(f"training failed for {config} {overrides}")
    rows = [json.loads(line) for line in (out / "pixelrl" / experiment / "metrics.jsonl").read_text().splitlines()]
    rows = rows[warmup:]
    step_s = float(np.mean([r["timing_s/step"] for r in rows]))
    images = int(rows[0]["training/images"])  # over all workers (perf/throughput is per worker)
    phases = {k[len("timing_s/"):]: float(np.mean([r.get(k, 0.0) for r in rows]))
              for k in rows[0] if k.startswith("timing_s/") and k != "timing_s/step"}
    return {"step_s": step_s, "images": images, "img_s": images / step_s, "phases": phases, "last": rows[-1]}
