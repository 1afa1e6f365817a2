"""`pixelrl report RUN`: one self-contained HTML page of a run, checked as text and as a real
headless Chromium renders it (installed by `make test` where the system allows)."""

import json
import shutil
import subprocess

import pytest
from conftest import train_cli


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory, tiny_pixel_path):
    """A 3-step Flow-GRPO run with a sample grid every step, a torn last metrics line, a prompt
    carrying markup, and its report."""
    from pixelrl.cli import main

    root = tmp_path_factory.mktemp("report")
    code, run = train_cli(root, tiny_pixel_path, "trainer.backend=local", "trainer.total_training_steps=3",
                          "trainer.log_image_grid_every=1", "trainer.experiment_name=flow_grpo_tiny",
                          "data.prompts=[a red circle, '<script>alert(1)</script> a cat', a tree, a star]")
    assert code == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "critic/rew')  # a run killed while writing its row
    assert main(["report", str(run)]) == 0
    return run, run / "report.html"


def test_the_page_holds_curves_grids_timings_and_config(reported_run):
    run, page = reported_run
    text = page.read_text()
    assert text.count('class="plot"') >= 3 and "critic/rewards/mean" in text and "timing_s/step" in text
    # every step's grid inlined: no file beside it is needed
    assert text.count('<figure class="grid"><img') == 3
    assert "3 logged rows, last step 3" in text  # the torn row is left out
    assert "<script>" not in text and "&lt;script&gt;" in text  # the prompt in the config is escaped
    assert "No validation was run" in text and "update_actor" in text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:3]]
    first, last = rows[0]["critic/rewards/mean"], rows[-1]["critic/rewards/mean"]
    assert f"critic/rewards/mean: {first:.4g} at step 1, {last:.4g} at step 3" in text


def test_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path, capsys):
    from pixelrl.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert "a run folder" in capsys.readouterr().err


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_the_page_renders_in_a_real_headless_browser(reported_run, tmp_path):
    """Chromium loads the page from disk with no network: the DOM it builds holds the curves and
    the three grids, and its screenshot shows them (the grids' noise images, not a blank page)."""
    import numpy as np
    from PIL import Image

    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here: `make test` installs Debian's `chromium` with apt-get where it may (root and "
                    "the package mirrors); the page's content checks above ran without it")
    _, page = reported_run
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count('class="plot"') >= 3 and dom.count('<figure class="grid"><img') == 3 and "pixelrl run" in dom
    # a wide window and a phone-wide one: the grids (scaled to the width, never cut off) show their noise
    for width in (1400, 420):
        shot = tmp_path / f"page_{width}.png"
        subprocess.run([browser, *flags, f"--screenshot={shot}", f"--window-size={width},2400", page.resolve().as_uri()],
                       capture_output=True, timeout=120)
        pixels = np.asarray(Image.open(shot).convert("RGB"))
        colourful = (pixels.max(axis=2).astype(int) - pixels.min(axis=2)) > 60  # the grids' saturated noise
        assert colourful.mean() > 0.02, (width, colourful.mean())
        # nothing is drawn past the window's right edge: the last column of pixels is the page's white
        assert (pixels[:, -3:] > 240).all(axis=2).mean() > 0.99, width


def test_chromium_renders_the_image_statistics_and_the_hacking_verdict(tmp_path, tiny_pixel_path):
    """A run that validates: the page Chromium renders draws each image and sample statistic of the
    validations as a curve and shows the hacking watch's verdict (here tripped by a brightness
    limit no update stays within)."""
    from pixelrl.cli import main
    from pixelrl.engine.image_stats import STATISTICS

    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here: `make test` installs Debian's `chromium` with apt-get where it may")
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"prompt": p, "data_source": "shapes"}) for p in ("a red circle", "a cat")))
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.total_training_steps=2",
                          f"data.val_files=[{val}]", "val_kwargs.n=2", "val_kwargs.num_steps=4",
                          "trainer.val_before_train=true", "trainer.test_freq=1",
                          "val_kwargs.hacking.drift={brightness: 1e-7}")
    assert code == 0 and main(["report", str(run)]) == 0
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    dom = subprocess.run([browser, *flags, "--dump-dom", (run / "report.html").resolve().as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    for name in (*STATISTICS, "x0_rms"):
        assert f"val-aux/image/{name}" in dom, name
    verdict = dom[dom.index('<div id="hacking">'):]
    assert verdict.index("step 1: reward hacking suspected: image_drift: brightness") < verdict.index("</div>")


def _run_folder(tmp_path, rows, config="trainer:\n  test_freq: -1\ndata:\n  val_files: [val.jsonl]\n"):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(config)
    return run


def test_a_diverged_run_marks_its_values_that_are_not_finite(tmp_path):
    """NaN and -Infinity rows are named in the curve's caption, drawn as crosses by `pixelrl plot`'s
    and the report's panels, and left out of the timing means with a note, not silently."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pixelrl.trainers.curves import draw_metric
    from pixelrl.trainers.report import write_report

    rows = [{"step": 1, "critic/rewards/mean": 0.5, "timing_s/step": 2.0},
            {"step": 2, "critic/rewards/mean": 0.6, "timing_s/step": 4.0},
            {"step": 3, "critic/rewards/mean": float("nan"), "timing_s/step": float("inf")},
            {"step": 4, "critic/rewards/mean": float("-inf"), "timing_s/step": 3.0}]
    run = _run_folder(tmp_path, rows)
    text = write_report(run).read_text()
    assert "critic/rewards/mean: 0.5 at step 1, 0.6 at step 2" in text
    assert "not finite at step 3 (NaN), 4 (-inf)" in text
    assert "<td>3.000</td><td>9.0 <span class=\"bad\">(1 not finite, left out)</span>" in text
    fig, ax = plt.subplots()
    draw_metric(ax, rows, "critic/rewards/mean")
    crosses = [line for line in ax.lines if line.get_label() == "not finite"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [3, 4]
    plt.close(fig)


def test_the_smoothed_line_is_a_debiased_moving_average_by_hand():
    from pixelrl.trainers.curves import smoothed

    # 0.4 * 1 / (1 - 0.6) = 1; (0.6 * 0.4 + 0.4 * 2) / (1 - 0.36) = 1.625
    assert smoothed([1.0, 2.0]) == pytest.approx([1.0, 1.625])
    assert smoothed([3.0] * 5) == pytest.approx([3.0] * 5)


def test_a_demos_held_out_tables_are_the_validation_section_as_html_tables(tmp_path):
    from pixelrl.trainers.report import write_report

    run = _run_folder(tmp_path, [{"step": 1, "critic/rewards/mean": 0.5}])
    (run / "demo_summary.json").write_text(json.dumps({"lines": [
        "held-out scores (<32> images)", "| | overall | counting |", "|---|---|---|",
        "| base | 0.52 | 0.40 |", "| step 10 | 0.63 | 0.55 |",
        "| model (exact) | overall |", "|---|---|", "| base | 0.41 |", "gain +0.11"]}))
    text = write_report(run).read_text()
    section = text[text.index('<div id="validation">'):text.index("<h2>Sample grids")]
    assert "<th>overall</th><th>counting</th>" in section and "<td>step 10</td><td>0.63</td>" in section
    assert "<td>0.55</td></tr></table></div>" in section  # two tables printed one under the other stay two
    assert '<table class="heldout"><tr><th>model (exact)</th><th>overall</th></tr><tr><td>base</td>' in section
    assert "<p>held-out scores (&lt;32&gt; images)</p>" in section and "gain +0.11" in section
    assert "|---|" not in text and "<pre class" not in text and "No validation was run" not in text


def test_the_validation_section_tabulates_the_logged_validations_or_says_why_there_are_none(tmp_path):
    from pixelrl.trainers.report import write_report

    rows = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "critic/rewards/mean": 0.5},
            {"step": 2, "val/accuracy": 0.75, "val-core/shapes/reward/mean@1": 0.25}]
    text = write_report(_run_folder(tmp_path / "a", rows)).read_text()
    assert ("<tr><td>0</td><td></td><td>0.5000</td></tr><tr><td>2</td><td>0.2500</td><td>0.7500</td></tr>"
            in text), text[text.index('<div id="validation">'):][:400]
    # data.val_files is set: the cause is test_freq, and the hint says so
    text = write_report(_run_folder(tmp_path / "b", rows[1:2])).read_text()
    assert "data.val_files is set but trainer.test_freq is -1" in text
    text = write_report(_run_folder(tmp_path / "c", rows[1:2], config="trainer:\n  test_freq: 5\n")).read_text()
    assert "set data.val_files and trainer.test_freq" in text
