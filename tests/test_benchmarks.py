"""The GPU benchmark runs its whole path on a CPU at tiny scale, so it cannot rot between the
sessions that have a GPU: folders build, `pixelrl train` runs each case, the table prints."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~18 s; run `pytest -m slow tests/test_benchmarks.py` before preparing a GPU session
def test_the_gpu_benchmark_runs_end_to_end_at_tiny_scale(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--scale", "tiny", "--device",
                           "cpu", "--cases", "sd35_fast_fit", "--steps", "2", "--profile-step", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert result["exit"] == 0, result.get("log_tail")
    # step 2 is profiled, so it is not part of the steady state: step 1 alone is
    assert result["timing_s/step"] > 0 and result["perf/denoiser_backwards"] > 0 and result["steps_measured"] == 1
    assert "| sd35_fast_fit |" in proc.stdout
    # the config's `auto` update micro-batch was chosen at start-up, with what it estimated
    assert "actor.ppo_micro_batch_size=" in result["sized"] and " s per step" in result["sized"]
    # trainer.profile_step reached the worker: its summary names the phases and the matmuls
    profile = Path(result["profile"]).read_text()
    assert "step 2 on cpu" in profile and "matmul" in profile
    assert "sampling" in profile and "update" in profile and Path(result["profile"]).with_suffix(".json.gz").exists()


def _one_case(tmp_path, case: str):
    """bench_gpu.py on one case at tiny scale on the CPU, 2 steps: its output and its result row,
    both checked to have succeeded."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--scale", "tiny", "--device",
                           "cpu", "--cases", case, "--steps", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert result["exit"] == 0, result.get("log_tail")
    return proc, result


@pytest.mark.slow  # ~15 s
def test_the_gpu_benchmark_runs_an_edit_family_on_its_edit_rows(tmp_path):
    """The flux_kontext case builds a Kontext folder and trains its preset on rows that name
    source images (a text-to-image prompt list would be refused by the edit family)."""
    proc, result = _one_case(tmp_path, "flux_kontext")
    assert result["timing_s/step"] > 0 and result["perf/denoiser_backwards"] > 0
    assert json.loads((tmp_path / "models" / "flux_kontext" / "model_index.json").read_text())["_class_name"] == \
        "FluxKontextPipeline"
    assert len(list((tmp_path / "edit_rows").glob("source_*.png"))) == 8


@pytest.mark.slow  # ~15 s
def test_the_gpu_benchmark_runs_the_dmd2_case(tmp_path):
    """dmd2_sd35's cycle (one rollout, five fake-score attempts, one student attempt) through the
    benchmark: both roles' phases timed."""
    proc, result = _one_case(tmp_path, "dmd2_sd35")
    assert result["timing_s/step"] > 0 and "fake_score" in proc.stdout and "student" in proc.stdout


@pytest.mark.slow  # ~15 s
def test_the_gpu_benchmark_runs_each_case_from_the_baseline_source_first(tmp_path):
    """--baseline-src: each case runs from the other version first (here a stand-in pixelrl that
    exits with 3), labelled `<case>_baseline`, then from this one, on the same folders."""
    stub = tmp_path / "base" / "pixelrl"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "__main__.py").write_text("raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--scale", "tiny", "--device",
                           "cpu", "--cases", "sd35_fast", "--steps", "1", "--out", str(tmp_path / "out"),
                           "--baseline-src", str(stub.parent)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(r["case"], r["exit"]) for r in rows] == [("sd35_fast_baseline", 3), ("sd35_fast", 0)]


@pytest.mark.slow  # ~20 s
def test_the_launch_count_sees_fewer_launches_in_fewer_micro_batches():
    """bench_launches counts the operators of the last step's rollout and update; the update of
    one micro-batch of 8 runs the model half as often as two of 4, and the rollout is the same."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_launches import count_case

    tiny = ["data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8"]
    two = count_case("shapes_demo", [*tiny, "actor.ppo_micro_batch_size=4"], steps=1)
    one = count_case("shapes_demo", [*tiny, "actor.ppo_micro_batch_size=8"], steps=1)
    assert sum(two["rollout"].values()) == sum(one["rollout"].values()) > 1000
    assert one["update"]["mm"] * 2 == two["update"]["mm"] > 0
    assert "view" not in one["update"] and "empty" not in one["update"]  # launch nothing
