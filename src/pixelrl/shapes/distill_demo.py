"""`pixelrl demo-distill`: RL, then distil, on the shapes model.

The teacher is an RL-trained shapes policy (the `make demo` run's final checkpoint by default:
AWM on the whole denoiser); the student, a fresh LoRA on the base, learns from its own samples
with on-policy distillation (`configs/shapes_opd.yaml`), no reward in its loss. The base, the
teacher and the student are scored on the same held-out items with the same sampler: the table
says how much of the teacher's RL gain the student holds, with paired 95% intervals.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DISTILL_CONFIG = "shapes_opd"


def demo_teacher(teacher: str | None) -> Path:
    """`--teacher`, else the final checkpoint of the `pixelrl demo` run in this folder."""
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError
    from pixelrl.shapes.demo import DEMO_CONFIG
    from pixelrl.trainers.checkpointing import find_resume_folder
    from pixelrl.trainers.run_folder import run_dir_of

    if teacher:
        return Path(teacher)
    checkpoints = run_dir_of(load_config(DEMO_CONFIG, [])) / "checkpoints"
    folder = find_resume_folder(checkpoints, "auto")
    if folder is None:
        raise ConfigError("--teacher", "(not given)", f"no `pixelrl demo` run is here to distil from ({checkpoints} holds no "
                          "checkpoint): run `make demo` first (about 15 minutes), or pass --teacher the "
                          "global_step_N folder of an RL run on builtin:shapes")
    return folder


def gain_lines(scored: dict[str, dict]) -> list[str]:
    """The student against the base and the teacher on each verdict (paired 95% intervals over
    items), and the share of the teacher's gain over the base that the student holds."""
    from pixelrl.shapes.evaluate import bootstrap_overall

    base, teacher, student = scored["base"], scored["teacher"], scored["student"]
    lines = []
    for score, overall in (("strict", "overall"), ("exact", "overall_exact"), ("careful", "overall_careful")):
        parts = []
        for name, other in (("base", base), ("teacher", teacher)):
            low, high = bootstrap_overall(student["items"], score, baseline=other["items"])
            parts.append(f"{student[overall] - other[overall]:+.3f} [{low:+.3f}, {high:+.3f}] over the {name}")
        teacher_gain = teacher[overall] - base[overall]
        held = (f"; of the teacher's {teacher_gain:+.3f} over the base it holds "
                f"{(student[overall] - base[overall]) / teacher_gain:.0%}" if teacher_gain > 0 else "")
        lines.append(f"{score}: student " + ", ".join(parts) + held)
    return lines


def run_distill_demo(overrides: list[str], per_category: int = 64, teacher: str | None = None) -> dict:
    from pixelrl.shapes.demo import comparison_grid, demo_setup, steps_line
    from pixelrl.shapes.evaluate import bootstrap_overall, evaluate_geneval
    from pixelrl.trainers.checkpointing import find_resume_folder, load_for_eval
    from pixelrl.trainers.controller import DiffusionTrainer

    teacher_folder = demo_teacher(teacher)
    # all three sampled as the student validates: the ODE at its steps, without guidance
    cfg, run_dir, items, eval_kwargs = demo_setup(DISTILL_CONFIG, [f"diffusion_loss.teacher={teacher_folder}",
                                                                   *overrides], per_category)
    started = time.time()
    scored: dict[str, dict] = {}

    def score(name: str, model) -> None:
        began = time.perf_counter()
        scored[name] = evaluate_geneval(model, items, progress=True, **eval_kwargs)
        scored[name]["seconds"] = time.perf_counter() - began

    score("base", load_for_eval(cfg.model.path))
    score("teacher", load_for_eval(checkpoint=str(teacher_folder)))
    student = f"LoRA r{cfg.model.lora_rank}" if cfg.model.lora_rank else "whole denoiser"
    print(f"pixelrl demo-distill: on-policy distillation of {teacher_folder} into a {student} on {cfg.model.path}, "
          f"{cfg.trainer.total_training_steps} steps of {cfg.data.train_batch_size} prompts x {cfg.rollout.n} images",
          flush=True)
    DiffusionTrainer(cfg).fit()
    final = find_resume_folder(run_dir / "checkpoints", "auto")
    score("student", load_for_eval(checkpoint=str(final)))

    labels = {"base": f"base ({cfg.model.path})", "teacher": f"teacher: RL ({teacher_folder.name})",
              "student": f"student: {student}, {final.name.rsplit('_', 1)[-1]} distillation steps"}
    printed = [steps_line(cfg, final),
               f"held-out scores (GenEval-style, {len(items)} images, {eval_kwargs['num_steps']} steps, guidance "
               f"{eval_kwargs['guidance_scale']:g}; [a, b] = 95% bootstrap interval over items)",
               "| model | strict | exact scene | careful judge | images/s (sampling and judging) |", "|---|---|---|---|---|"]
    for name, result in scored.items():
        cells = []
        for verdict, overall in (("strict", "overall"), ("exact", "overall_exact"), ("careful", "overall_careful")):
            low, high = bootstrap_overall(result["items"], verdict)
            cells.append(f"{result[overall]:.3f} [{low:.3f}, {high:.3f}]")
        printed.append(f"| {labels[name]} | " + " | ".join(cells) + f" | {len(items) / result['seconds']:.0f} |")
    printed += gain_lines(scored)
    print("\n" + "\n".join(printed))
    grid = run_dir / "base_teacher_student.png"
    comparison_grid([(name, scored[name]["images"]) for name in ("base", "teacher", "student")], items, grid)
    summary = {
        **{name: {k: result[k] for k in ("strict", "exact", "overall", "overall_exact", "overall_careful",
                                         "extra_objects", "seconds")} for name, result in scored.items()},
        "teacher_checkpoint": str(teacher_folder), "student_checkpoint": str(final), "evaluated_with": eval_kwargs,
        "minutes": (time.time() - started) / 60, "config_name": DISTILL_CONFIG, "overrides": list(overrides),
        "lines": printed,
    }
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    from pixelrl.trainers.report import write_report

    print(f"wrote {grid}, {run_dir / 'demo_summary.json'}, {write_report(run_dir)} ({summary['minutes']:.1f} min)")
    return summary
