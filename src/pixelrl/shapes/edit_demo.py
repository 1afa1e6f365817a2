"""`pixelrl demo-edit`: RL on the shipped shapes editing model, with a before/after evaluation.

1. Edit the held-out test items (64 (instruction, seed) pairs per kind of edit, instructions never
   trained on; each seed draws its source scene) with the base model `builtin:shapes_edit`
   (FLUX.1 Kontext's layout) and judge the edits (`edit_evaluate`).
2. Train with `configs/shapes_edit_demo.yaml` through the regular trainer: rows of (instruction,
   source image) from `builtin:shapes_edit/train`, the `shapes_edit` detector reward.
3. Edit the same items with the trained policy; print success per kind of edit with 95% intervals,
   the paired gains, what the careful judge says and how much of the source survives, and write a
   grid (source, base edit, trained edit) and the run report into the run folder.
"""

from __future__ import annotations

import json
import time

EDIT_DEMO_CONFIG = "shapes_edit_demo"
VERDICTS = (("exact", "edit succeeded (exact)"), ("followed", "instruction followed"),
            ("kept", "untouched objects kept"), ("careful", "careful judge"), ("pixels_kept", "source pixels kept"))


def gain_lines(base: dict, trained: dict) -> list[str]:
    """Each verdict's overall before -> after with the paired 95% interval of the gain."""
    from pixelrl.shapes.evaluate import bootstrap_overall

    lines = []
    for key, label in VERDICTS:
        low, high = bootstrap_overall(trained["items"], key, baseline=base["items"])
        lines.append(f"{label}: {base[key]:.3f} -> {trained[key]:.3f} ({trained[key] - base[key]:+.3f}, paired 95% "
                     f"interval [{low:+.3f}, {high:+.3f}])")
    extra = [sum(r["extra_objects"] for r in result["items"]) / len(result["items"]) for result in (base, trained)]
    lines.append(f"objects nobody asked for per edit: {extra[0]:.2f} -> {extra[1]:.2f}")
    return lines


def run_edit_demo(overrides: list[str], per_edit: int = 64) -> dict:
    from pixelrl.config import load_config
    from pixelrl.config.sections import validation_guidance
    from pixelrl.core.errors import ConfigError
    from pixelrl.shapes import edit_world
    from pixelrl.shapes.demo import comparison_grid, steps_line
    from pixelrl.shapes.edit_evaluate import careful_reasons, evaluate_edits, format_edit_table
    from pixelrl.shapes.evaluate import bootstrap_overall
    from pixelrl.trainers.checkpointing import find_resume_folder, load_for_eval
    from pixelrl.trainers.controller import DiffusionTrainer
    from pixelrl.trainers.run_folder import run_dir_of

    cfg = load_config(EDIT_DEMO_CONFIG, overrides)
    if cfg.trainer.save_freq == -1:
        raise ConfigError("trainer.save_freq", -1, "the demo evaluates the trained model from its final checkpoint: "
                          "use 0 (save only at the last step) or a positive interval")
    run_dir = run_dir_of(cfg)
    items = edit_world.evaluation_items("test", per_edit=per_edit)
    eval_kwargs = dict(num_steps=cfg.val_kwargs.num_steps, guidance_scale=validation_guidance(cfg),
                       resolution=cfg.rollout.resolution)
    started = time.time()
    base = evaluate_edits(load_for_eval(cfg.model.path), items, progress=True, **eval_kwargs)
    print(format_edit_table(base, "base model (held-out test)"), flush=True)

    DiffusionTrainer(cfg).fit()
    final = find_resume_folder(run_dir / "checkpoints", "auto")
    steps = int(final.name.rsplit("_", 1)[-1])
    trained = evaluate_edits(load_for_eval(checkpoint=str(final)), items, progress=True, **eval_kwargs)

    printed = [steps_line(cfg, final),
               f"held-out edits ({len(items)} edits, {per_edit} per kind, instructions never trained on; "
               f"{eval_kwargs['num_steps']} steps, guidance {eval_kwargs['guidance_scale']:g}; [a, b] = 95% bootstrap "
               "interval over items)"]
    for score in ("exact", "careful", "kept"):
        for result in (base, trained):
            result[f"{score}_interval"] = bootstrap_overall(result["items"], score)
        table = format_edit_table(base, "base", score).splitlines()
        table.append(format_edit_table(trained, f"after {steps} steps", score).splitlines()[-1])
        printed += table
    printed += gain_lines(base, trained)
    rejects = ", ".join(f"{reason} {share:.1%}" for reason, share in careful_reasons(trained).items())
    printed.append(f"edits the lenient verdict passes and the careful judge rejects, after training: {rejects or 'none'}")
    print("\n" + "\n".join(printed))
    grid = run_dir / "source_base_trained.png"
    comparison_grid([("source", base["sources"]), ("base", base["images"]), ("trained", trained["images"])], items,
                    grid, categories=edit_world.EDITS, key="edit")
    keys = [k for k in base if k.endswith("_by_edit") or k in ("exact", "followed", "kept", "careful", "partial",
                                                                 "pixels_kept")]
    summary = {"before": {k: base[k] for k in keys}, "after": {k: trained[k] for k in keys},
               "evaluated_checkpoint": str(final), "evaluated_with": eval_kwargs,
               "minutes": (time.time() - started) / 60, "config_name": EDIT_DEMO_CONFIG, "overrides": list(overrides),
               "lines": printed}
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    from pixelrl.trainers.report import write_report

    print(f"wrote {grid}, {run_dir / 'demo_summary.json'}, {write_report(run_dir)} ({summary['minutes']:.1f} min)")
    return summary
