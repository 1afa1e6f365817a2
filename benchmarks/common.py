"""Shared by the benchmark scripts: run `pixelrl train` and summarise its per-step metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def train_and_measure(config: str, model: Path, out: Path, experiment: str, overrides: list[str]) -> dict:
    """Run the trainer; return mean seconds per step and per phase over all steps but the first
    (warm-up), plus the images per step."""
    from pixelrl.cli import main

    code = main(["train", "--config-name", config, f"model.path={model}", f"trainer.default_local_dir={out}",
                 f"trainer.experiment_name={experiment}", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 *overrides])
    if code != 0:
        raise SystemExit(f"training failed for {config} {overrides}")
    rows = [json.loads(line) for line in (out / "pixelrl" / experiment / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = float(np.mean([r["timing_s/step"] for r in rows]))
    images = int(round(rows[0]["perf/throughput"] * rows[0]["timing_s/step"]))
    phases = {k[len("timing_s/"):]: float(np.mean([r.get(k, 0.0) for r in rows]))
              for k in rows[0] if k.startswith("timing_s/") and k != "timing_s/step"}
    return {"step_s": step_s, "images": images, "img_s": images / step_s, "phases": phases}
