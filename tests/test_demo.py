"""`pixelrl demo`'s report (gains with paired intervals, category drops, extra objects, diversity),
its before/after grid and a short end-to-end run of it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pixelrl.shapes.demo import demo_report


def _scored(strict_per_item: list[int], exact_per_item: list[int], categories: list[str], extra: float) -> dict:
    items = [{"prompt": f"p{i}", "seed": i, "category": c, "strict": s, "exact": e, "partial": s}
             for i, (s, e, c) in enumerate(zip(strict_per_item, exact_per_item, categories))]
    by_cat = {c: [it for it in items if it["category"] == c] for c in dict.fromkeys(categories)}
    strict = {c: sum(it["strict"] for it in rows) / len(rows) for c, rows in by_cat.items()}
    exact = {c: sum(it["exact"] for it in rows) / len(rows) for c, rows in by_cat.items()}
    return {"items": items, "strict": strict, "exact": exact, "overall": sum(strict.values()) / len(strict),
            "overall_exact": sum(exact.values()) / len(exact), "overall_partial": sum(strict.values()) / len(strict),
            "extra_objects": extra}


CATS = ["a"] * 4 + ["b"] * 4


def test_an_honest_gain_reports_its_interval_and_no_category_drop():
    base = _scored([0, 0, 0, 1, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0, 1, 1], CATS, 0.1)
    after = _scored([1, 1, 0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 1, 0, 1, 1], CATS, 0.1)
    # strict: a 0.25 -> 0.75, b 0.5 -> 0.75: overall 0.375 -> 0.75 (+0.375); exact the same
    report = demo_report(base, after, {"pairwise_l1": 0.10, "distinct_pair_fraction": 1.0},
                         {"pairwise_l1": 0.095, "distinct_pair_fraction": 1.0})
    assert "criteria" not in report and not any("criteria" in line for line in report["lines"])
    assert report["strict_gain_interval"][0] > 0
    assert "+0.375" in report["lines"][0]
    assert "no category drops (smallest change: b +0.250)" in report["lines"][1]


def test_a_hacked_gain_shows_in_the_exact_score_the_category_drop_extra_objects_and_diversity():
    base = _scored([0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1], CATS, 0.1)
    # every category-a image passes "at least" strict but holds extra objects; b loses one image
    after = _scored([1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 0], CATS, 0.8)
    report = demo_report(base, after, {"pairwise_l1": 0.10, "distinct_pair_fraction": 1.0},
                         {"pairwise_l1": 0.08, "distinct_pair_fraction": 0.9})
    # strict 0.75 -> 0.875 looks like a gain; exact 0.75 -> 0.375 and the rest say what it is
    assert "(+0.125," in report["lines"][0] and "(-0.375 [" in report["lines"][0]
    assert "largest category drop: b -0.250" in report["lines"][1] and "0.10 -> 0.80" in report["lines"][1]
    assert "0.100 -> 0.080 (-20%)" in report["lines"][2]
    base.update(background_level=1.95, background_specks=0.021)
    after.update(background_level=7.29, background_specks=0.061)
    line = demo_report(base, after, {"pairwise_l1": 0.10, "distinct_pair_fraction": 1.0},
                       {"pairwise_l1": 0.08, "distinct_pair_fraction": 0.9})["lines"][-1]
    assert line == "background (pixels darker than 48): mean level 1.95 -> 7.29 of 255, brighter than 12: 2.1% -> 6.1%"


def test_the_demo_runs_end_to_end_and_writes_its_summary(tmp_path, capsys):
    from pixelrl.shapes.demo import run_demo

    # one in-process worker instead of the config's two Ray workers: this tests the demo's report
    summary = run_demo([f"trainer.default_local_dir={tmp_path}", "trainer.backend=local",
                        "trainer.n_workers=1", "trainer.total_training_steps=2",
                        "data.train_batch_size=2", "rollout.n=4", "actor.ppo_micro_batch_size=8",
                        "trainer.save_freq=2", "val_kwargs.guidance_scale=2.5"], per_category=2)
    printed = capsys.readouterr().out
    assert "| model (exact) |" in printed and "paired 95% interval" in printed and "criteria" not in printed
    assert "trained all 2 steps" in printed
    written = json.loads((tmp_path / "pixelrl" / "shapes_demo" / "demo_summary.json").read_text())
    assert written["paired_strict_interval"] == list(summary["paired_strict_interval"])
    assert set(written["before"]["strict"]) == set(written["after"]["strict"])
    assert (tmp_path / "pixelrl" / "shapes_demo" / "before_after.png").is_file()
    # judged with the validation's guidance, not the (CFG-free) rollouts'
    assert written["evaluated_with"]["guidance_scale"] == 2.5 and "guidance 2.5;" in printed
    # and the run report shows the held-out tables as printed, and the before / after picture
    page = (tmp_path / "pixelrl" / "shapes_demo" / "report.html").read_text()
    assert "paired 95% interval" in page and 'alt="before_after.png"' in page and "<th>model (exact)</th>" in page


def test_a_demo_cut_short_by_its_time_budget_says_so_beside_its_table():
    from types import SimpleNamespace

    from pixelrl.shapes.demo import steps_line

    cfg = SimpleNamespace(trainer=SimpleNamespace(total_training_steps=210, time_budget_s=840.0))
    assert steps_line(cfg, Path("runs/x/checkpoints/global_step_210")) == "trained all 210 steps"
    assert steps_line(cfg, Path("global_step_126")) == (
        "trained 126 of 210 steps: trainer.time_budget_s=840 s ran out (a slower or busier CPU fits fewer steps); "
        "these results are not the documented 210-step run's")


def test_grid_captions_break_between_words():
    """A caption wider than its cell breaks at a space, never inside a word ("a triang / le"), in
    the largest font (12 px down to 8) in which every word fits, and is drawn whole: the caption
    band grows to the longest caption's lines. Only a word wider than a line at 8 px is cut."""
    from unittest import mock

    from pixelrl.trainers import tracking

    drawn = []
    with mock.patch.object(tracking.ImageDraw.ImageDraw, "text",
                           lambda self, xy, text, **kw: drawn.append((text, kw["font"]))):
        grid = tracking.image_grid(np.zeros((2, 16, 16, 3), np.uint8), ["two red squares and a blue triangle", "a"],
                                   scale=3)
    assert [text for text, _ in drawn] == ["two red", "squares", "and a", "blue", "triangle", "a"]
    assert {font.size for _, font in drawn} == {11}  # "triangle" is 45 px at 12 px: 11 px fits the 44 px line
    assert all(font.getlength(text) <= 44 for text, font in drawn)
    assert grid.shape == (48 + 5 * (11 + 3) + 4, 2 * 48, 3)
    font = tracking.caption_font([], 40)
    assert tracking.wrap_to_width("abcdefghijklmnopqrstuvwxyz x", font, 40) == ["abcdef", "ghijkl", "mnopq",
                                                                                "rstuvw", "xyz x"]


def test_curve_axes_sum_step_times_and_images():
    from pixelrl.trainers.tracking import x_axis

    rows = [{"step": 0, "val-core/a/reward/mean@4": 0.3},  # validation before training: no step time
            {"step": 1, "timing_s/step": 30.0, "perf/throughput": 2.0},  # 60 images
            {"step": 2, "timing_s/step": 90.0, "perf/throughput": 4.0},  # 360 images
            # the step's images over all workers are logged; throughput is then per worker
            {"step": 3, "timing_s/step": 30.0, "perf/throughput": 1.0, "training/images": 60}]
    assert x_axis(rows, "step") == {0: 0, 1: 1, 2: 2, 3: 3}
    assert x_axis(rows, "minutes") == {0: 0.0, 1: 0.5, 2: 2.0, 3: 2.5}
    assert x_axis(rows, "images") == {0: 0, 1: 60, 2: 420, 3: 480}


def test_validation_curves_average_the_categories(tmp_path):
    from pixelrl.shapes.demo import plot_validation_curves, validation_curves

    rows = [{"step": 0, "val-aux/colors/shapes_strict/mean@4": 0.2, "val-aux/position/shapes_strict/mean@4": 0.4,
             "val-aux/colors/shapes_exact/mean@4": 0.1, "val-aux/position/shapes_exact/mean@4": 0.3,
             "val-core/colors/diversity@4": 0.10, "val-core/position/diversity@4": 0.20,
             "val-core/colors/reward/mean@4": 9.0, "val-aux/colors/shapes_extra_objects/mean@4": 9.0},
            {"step": 1, "timing_s/step": 60.0, "perf/throughput": 1.0},
            {"step": 2, "timing_s/step": 60.0, "perf/throughput": 1.0, "val-aux/colors/shapes_strict/mean@4": 0.5}]
    curves = validation_curves(rows)
    assert curves["shapes_strict"] == [(0, pytest.approx(0.3)), (2, 0.5)]
    assert curves["shapes_exact"] == [(0, pytest.approx(0.2))]
    assert curves["diversity"] == [(0, pytest.approx(0.15))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    assert plot_validation_curves(metrics, tmp_path / "curve.png") and (tmp_path / "curve.png").stat().st_size > 0
    assert not plot_validation_curves(tmp_path / "missing.jsonl", tmp_path / "none.png")


def test_the_demo_trains_each_workers_share_in_one_micro_batch_with_the_same_update(tmp_path, capsys):
    """`actor.ppo_micro_batch_size: auto` in the demo: each of the two CPU workers' 32 samples (the
    size every demo number was measured with), all 64 on one GPU-sized worker, where the tiny
    model's update is bound by kernel launches. The demo's AWM update (per-sample timesteps, whole
    denoiser, reference term) is the same in one micro-batch as in two, up to float reordering."""
    from pixelrl.config import load_config
    from pixelrl.core.batch import Batch
    from pixelrl.engine import PolicyEngine

    base = [f"trainer.default_local_dir={tmp_path}"]
    assert load_config("shapes_demo", base).actor.ppo_micro_batch_size == 32
    one_gpu = load_config("shapes_demo", [*base, "trainer.backend=local", "trainer.n_workers=1",
                                          "trainer.fit_to_memory_gb=80"])
    assert one_gpu.actor.ppo_micro_batch_size == 64
    assert "actor.ppo_micro_batch_size=64" in capsys.readouterr().err

    gradients = []
    for micro in (4, 8):
        cfg = dataclasses.replace(one_gpu, actor=dataclasses.replace(one_gpu.actor, ppo_micro_batch_size=micro,
                                                                     ppo_mini_batch_size=8))
        engine = PolicyEngine.from_config(cfg)
        engine.learner.optimizer.register_step_pre_hook(  # the accumulated gradient, as applied
            lambda optimizer, args, kwargs, _params=engine.learner.params: gradients.append(
                torch.cat([p.grad.flatten() for p in _params])))
        prompts = ["a red circle", "two blue squares"] * 4
        x0 = engine.rollout(prompts[:2], [1, 2])["x0"][[0, 1] * 4]
        metrics = engine.update(Batch({"x0": x0, "advantages": torch.linspace(-1.5, 1.5, 8)},
                                      {"prompts": prompts, "uids": list("abababab")}))
        assert metrics["policy_version"] == 1
    scale = gradients[0].abs().max()
    assert scale > 0 and (gradients[0] - gradients[1]).abs().max() < 1e-5 * scale


def test_background_noise_counts_the_dim_pixels_a_detector_ignores():
    """Background = pixels whose brightest channel is below 48: their mean level and the share
    brighter than 12. Hand-computed on one 2 x 2 image: a shape pixel (200) is not background; the
    three others have brightest channels 0, 20 and 10, mean 10, one of three above 12."""
    from pixelrl.shapes.detector import background_noise

    image = torch.zeros(1, 2, 2, 3, dtype=torch.uint8)
    image[0, 0, 0] = torch.tensor([200, 0, 0])
    image[0, 0, 1] = torch.tensor([5, 20, 3])
    image[0, 1, 0] = torch.tensor([10, 0, 0])
    noise = background_noise(image)
    assert noise["background_level"] == pytest.approx(10.0)
    assert noise["background_specks"] == pytest.approx(1 / 3)
    assert background_noise(torch.zeros(2, 4, 4, 3, dtype=torch.uint8)) == {"background_level": 0.0,
                                                                            "background_specks": 0.0}


def test_plot_reads_a_run_killed_mid_write_and_names_a_damaged_line(tmp_path, capsys):
    """A torn last metrics line (a kill mid-write) is left out, as a resume drops it; a damaged line
    before the last is one error naming the line, not a JSONDecodeError."""
    import json

    from pixelrl.cli import main

    rows = [json.dumps({"step": s, "critic/rewards/mean": 0.1 * s, "timing_s/step": 1.0}) for s in (1, 2, 3)]
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(rows) + '\n{"step": 4, "critic/rew')
    assert main(["plot", str(torn), "--out", str(tmp_path / "c.png"), "--keys", "critic/*"]) == 0
    assert (tmp_path / "c.png").is_file()
    # without --out the figure goes beside the run's metrics; panels follow the order of --keys
    from pixelrl.trainers.tracking import plot_metrics

    assert main(["plot", str(torn)]) == 0 and (tmp_path / "metrics.png").is_file()
    assert plot_metrics(torn, ["timing_s/*", "critic/*"], tmp_path / "e.png") == ["timing_s/step",
                                                                                  "critic/rewards/mean"]
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([rows[0], '{"step": 2, "crit', rows[2]]) + "\n")
    assert main(["plot", str(damaged), "--out", str(tmp_path / "d.png")]) == 2
    assert "line 2 is not a JSON row" in capsys.readouterr().err


def test_the_distillation_demo_says_what_share_of_the_teachers_gain_the_student_holds():
    """Each verdict: the student against the base and the teacher with paired intervals, and
    (student - base) / (teacher - base) when the teacher gained at all."""
    from pixelrl.shapes.distill_demo import gain_lines

    def scored(strict, exact):
        result = _scored(strict, exact, CATS, 0.0)
        result["overall_careful"] = float(np.mean(exact))
        for item, passed in zip(result["items"], exact):
            item["careful"] = float(passed)
        return result

    lines = gain_lines({"base": scored([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]),
                        "teacher": scored([1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]),
                        "student": scored([1, 1, 1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1])})
    assert lines[0].startswith("strict: student +0.375 [") and "-0.125 [" in lines[0]
    assert lines[0].endswith("of the teacher's +0.500 over the base it holds 75%")
    assert "holds" not in lines[1] and "holds" not in lines[2]  # the teacher gained nothing there


def test_the_distillation_demo_distils_the_demos_policy_end_to_end(tmp_path, monkeypatch, capsys):
    """`pixelrl demo-distill` in a folder where `pixelrl demo` ran: its final checkpoint (a whole
    fine-tuned denoiser) teaches a LoRA student; the table holds base, teacher and student, and
    the picture their images of the same items. Where no demo ran, --teacher is asked for."""
    from pixelrl.cli import main
    from pixelrl.shapes.demo import run_demo

    monkeypatch.chdir(tmp_path)
    small = ["trainer.backend=local", "trainer.n_workers=1", "trainer.total_training_steps=2", "data.train_batch_size=2",
             "rollout.n=4", "actor.ppo_micro_batch_size=8", "trainer.save_freq=2"]
    assert main(["demo-distill", *small]) == 2
    err = capsys.readouterr().err
    assert "--teacher" in err and "run `make demo` first" in err
    run_demo(small, per_category=2)
    capsys.readouterr()
    assert main(["demo-distill", "--per-category", "2", *small]) == 0
    printed = capsys.readouterr().out
    assert "runs/pixelrl/shapes_demo/checkpoints/global_step_2 into a LoRA r32" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "[" in line]
    assert [row.split(" |")[0] for row in rows] == ["| base (builtin:shapes)", "| teacher: RL (global_step_2)",
                                                    "| student: LoRA r32, 2 distillation steps"]
    run = tmp_path / "runs" / "pixelrl" / "shapes_opd"
    summary = json.loads((run / "demo_summary.json").read_text())
    assert set(summary) >= {"base", "teacher", "student"} and summary["teacher_checkpoint"].endswith("global_step_2")
    assert (run / "base_teacher_student.png").is_file()
    page = (run / "report.html").read_text()  # the run report shows the table printed, and the picture
    assert "<td>student: LoRA r32, 2 distillation steps</td>" in page and 'alt="base_teacher_student.png"' in page
