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
    assert text.count("<svg") >= 3 and "critic/rewards/mean" in text and "timing_s/step" in text
    assert text.count("data:image/png;base64,") == 3  # every step's grid inlined: no file beside it is needed
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
    assert dom.count("<svg") >= 3 and dom.count("<img") == 3 and "pixelrl run" in dom
    shot = tmp_path / "page.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1400,1000", page.resolve().as_uri()],
                   capture_output=True, timeout=120)
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    colourful = (pixels.max(axis=2).astype(int) - pixels.min(axis=2)) > 60  # the grids' saturated noise
    assert colourful.mean() > 0.02, colourful.mean()
