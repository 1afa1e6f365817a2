"""The package installs beside the torch a user has: its metadata takes a range, and only the
Makefile's set-up pins the CPU wheel this suite runs on."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_takes_a_torch_range_that_keeps_a_gpu_users_build():
    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    torch = deps["torch"].specifier
    # each tried with benchmarks/version_matrix.py (docs/benchmarks.md); a CUDA 2.11 stays
    for version in ("2.11.0", "2.11.0+cu128", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0+cu132"):
        assert torch.contains(version, prereleases=True), version
    assert not torch.contains("2.16.0")  # not yet released, so not run here


def test_the_makefile_pins_the_torch_this_suite_runs_on():
    import torch

    pins = [Requirement(line) for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert [str(p) for p in pins] == [f"torch=={torch.__version__.split('+')[0]}"]
    assert "-c requirements/cpu.txt" in (ROOT / "Makefile").read_text()
