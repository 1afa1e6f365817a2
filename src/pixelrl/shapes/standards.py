"""Reproducibility standards: short tiny-model runs whose per-step metrics are committed, one per
trainer kind, and `pixelrl reproduce NAME` to rerun one and compare it with its record.

Each standard builds its tiny random model from a seed and trains three steps in-process
(`trainer.backend=local`), in a child process whose kernels are the same on every x86 CPU
(`PORTABLE`: torch's unvectorised kernels, MKL's conditional-reproducibility mode, oneDNN held to
SSE4.1, one thread), and compares every learning metric of every step (losses, rewards,
advantages, gradient norms, ratios; not timings) with the record in
`assets/standards/<name>.json`: bitwise, or within `RTOL` / `ATOL` where kernels differ.
docs/runtime.md (reproducibility standards) has what was measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pixelrl.core.errors import ConfigError

STANDARDS_DIR = Path(__file__).resolve().parents[1] / "assets" / "standards"
# the same arithmetic on every x86 CPU: each library's own CPU dispatch turned off, one thread
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# where the kernels still differ (another torch, a CPU MKL treats apart), a value may move by float
# rounding, and a JPEG size by a byte after a step: 1.3% was the largest move between torch's
# no-vector, AVX2 and AVX-512 kernels (docs/runtime.md); values below ATOL are rounding noise
RTOL, ATOL = 0.05, 1e-6
# every number of a row but what differs run to run (timings, throughput, memory) and the counters
NOT_COMPARED = ("timing", "timeline/", "throughput", "mfu", "memory", "peak", "_s/", "perf/", "training/")


@dataclass(frozen=True)
class Standard:
    config: str
    overrides: tuple[str, ...]
    model: str = "sd3_pixel"  # which tiny model (`_build_model`)
    teacher_steps: int = 0  # OPD: first train this many steps of the base config as the teacher
    what: str = ""


COMMON = ("trainer.backend=local", "trainer.logger=[jsonl]", "trainer.num_cpus_per_worker=1", "trainer.save_freq=-1",
          "trainer.resume_mode=disable", "trainer.total_training_steps=3")
STANDARDS: dict[str, Standard] = {
    "flow_grpo": Standard("flow_grpo_tiny", (), what="a transition loss (Flow-GRPO's clipped ratio on SDE steps)"),
    "nft": Standard("nft_tiny", (), what="DiffusionNFT (forward process, the old adapter)"),
    "awm": Standard("awm_tiny", (), what="AWM (forward process, advantage-weighted matching)"),
    "dgpo": Standard("dgpo_tiny", (), what="DGPO (forward process, group preference weights)"),
    "dpo": Standard("dpo_tiny", (), what="online Diffusion-DPO (forward process, pairs)"),
    "dmd2": Standard("dmd2_tiny", (), what="DMD2 (two trained roles, its cycle)"),
    "opd": Standard("flow_grpo_tiny", ("diffusion_loss.name=distill_kl", "algorithm.drop_zero_advantage=false"),
                    teacher_steps=2, what="on-policy distillation toward a teacher LoRA (a 2-step RL run's)"),
    "vlm_grpo": Standard("vlm_grpo_shapes_qa", ("data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
                                               "actor.ppo_micro_batch_size=8", "vlm.val_items=8", "trainer.test_freq=3",
                                               "trainer.n_workers=1"),
                         model="qwen_vl", what="the vision-language trainer (GRPO on shapes-QA)"),
}


def _build_model(kind: str, folder: Path) -> Path:
    if kind == "qwen_vl":
        from pixelrl.models.qwen_vl.tiny import build_tiny_qwen_vl
        from pixelrl.shapes import qa as shapes_qa

        return build_tiny_qwen_vl(folder, words=shapes_qa.vocabulary(), seed=0)
    from pixelrl.models import build_tiny_sd3

    return build_tiny_sd3(folder, resolution=32, with_vae=False, with_t5=False, seed=0)


def _train(config: str, overrides: list[str]) -> list[dict]:
    from pixelrl.config import load_config
    from pixelrl.trainers.restarts import fit_with_restarts
    from pixelrl.trainers.tracking import read_metric_rows

    result = fit_with_restarts(load_config(config, overrides), console=lambda line: None)  # the rows speak
    return read_metric_rows(Path(result["run_dir"]) / "metrics.jsonl")


def compared_values(rows: list[dict]) -> dict[str, float]:
    """`key@step` -> value of every learning metric of every row."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and not any(word in key for word in NOT_COMPARED) \
                    and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{key}@{row['step']:g}"] = float(value)
    return out


def run_standard(name: str, workdir: Path) -> dict[str, float]:
    """Run standard `name` in `workdir`, in this process as it is set up; its compared values."""
    import torch

    standard = STANDARDS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction's order follows the thread count: one thread is one order
    try:
        model = _build_model(standard.model, workdir / "model")
        base = [f"model.path={model}", f"trainer.default_local_dir={workdir / 'runs'}", *COMMON]
        extra = []
        if standard.teacher_steps:
            _train(standard.config, [*base, f"trainer.total_training_steps={standard.teacher_steps}",
                                     f"trainer.save_freq={standard.teacher_steps}", "trainer.experiment_name=teacher",
                                     "actor.lr=3e-2"])
            extra = [f"diffusion_loss.teacher={workdir / 'runs/pixelrl/teacher/checkpoints'}"
                     f"/global_step_{standard.teacher_steps}"]
        rows = _train(standard.config, [*base, *standard.overrides, *extra, f"trainer.experiment_name={name}"])
    finally:
        torch.set_num_threads(threads)
    return compared_values(rows)


def run_portably(names: list[str], workdir: Path) -> dict:
    """Run standards in a child process under PORTABLE (the libraries read it as they load):
    {"machine": ..., "values": {name: compared values}}."""
    out = workdir / "values.json"
    code = "import sys; from pixelrl.shapes.standards import _child; _child(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(workdir), str(out), *names],
                          env={**os.environ, **PORTABLE}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the standards' run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _child(argv: list[str]) -> None:
    workdir, out, names = Path(argv[0]), Path(argv[1]), argv[2:]
    values = {name: run_standard(name, workdir / name) for name in names}
    out.write_text(json.dumps({"machine": machine(), "values": values}))


def machine() -> dict:
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": _processor(), "python": platform.python_version()}


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record_path(name: str) -> Path:
    return STANDARDS_DIR / f"{name}.json"


def load_record(name: str) -> dict:
    path = record_path(name)
    if not path.is_file():
        raise ConfigError("standard", name, f"has no record at {path}: run `pixelrl reproduce {name} --record`")
    return json.loads(path.read_text())


@dataclass
class Comparison:
    name: str
    compared: int = 0
    equal: int = 0
    max_relative: float = 0.0
    worst: str = ""
    outside: int = 0  # values beyond RTOL and ATOL
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def bitwise(self) -> bool:
        return self.equal == self.compared and not self.missing and not self.extra

    @property
    def passed(self) -> bool:
        return not self.missing and not self.extra and not self.outside

    def verdict(self) -> str:
        if self.missing or self.extra:
            return (f"DIFFERS: {len(self.missing)} recorded values not logged ({', '.join(self.missing[:3])}), "
                    f"{len(self.extra)} logged values not recorded ({', '.join(self.extra[:3])})")
        if self.bitwise:
            return f"bitwise: {self.compared} values equal"
        within = f"{self.outside} DIFFER beyond" if self.outside else "within"
        return (f"{self.equal} of {self.compared} values equal, {within} rtol {RTOL:g} / atol {ATOL:g}; largest "
                f"relative difference {self.max_relative:.3g} ({self.worst})")


def compare(name: str, recorded: dict[str, float], measured: dict[str, float]) -> Comparison:
    result = Comparison(name, missing=sorted(set(recorded) - set(measured)),
                        extra=sorted(set(measured) - set(recorded)))
    for key in sorted(set(recorded) & set(measured)):
        a, b = recorded[key], measured[key]
        result.compared += 1
        if a == b or (math.isnan(a) and math.isnan(b)):
            result.equal += 1
            continue
        result.outside += not abs(a - b) <= ATOL + RTOL * max(abs(a), abs(b))
        relative = abs(a - b) / max(abs(a), abs(b), 1e-12)
        if relative > result.max_relative:
            result.max_relative, result.worst = relative, f"{key}: {a!r} recorded, {b!r} now"
    return result


def reproduce(names: list[str], workdir: Path, record: bool = False) -> tuple[dict, dict[str, Comparison | Path]]:
    """Rerun `names` portably and compare each with its record, or (`record`) write the records.
    Returns the machine it ran on and, per name, its comparison or the record written."""
    ran = run_portably(names, workdir)
    results: dict[str, Comparison | Path] = {}
    for name in names:
        measured = ran["values"][name]
        if record:
            STANDARDS_DIR.mkdir(parents=True, exist_ok=True)
            standard = STANDARDS[name]
            payload = {"standard": name, "what": standard.what, "config": standard.config,
                       "overrides": list(standard.overrides), "recorded_on": ran["machine"],
                       "portable": PORTABLE, "values": measured}
            record_path(name).write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
            results[name] = record_path(name)
        else:
            results[name] = compare(name, load_record(name)["values"], measured)
    return ran["machine"], results
