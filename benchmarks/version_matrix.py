"""Install pixelrl beside each torch release its metadata allows and run a fast subset of the
tests there: the table of versions tried in docs/benchmarks.md ("Installing beside your torch").

    python benchmarks/version_matrix.py [--torch 2.11.0,2.12.1] [--venvs /tmp/pixelrl_versions]

For each torch version: a throwaway venv gets that torch first (from the package index: the CUDA
build where that is what the index holds; it runs on the CPU), then `pip install --dry-run -e .`
must not plan to replace it, then `pip install -e .[test,ocr]` and the subset below. The other
dependencies are pinned to one minor release each in pyproject.toml, so torch is the axis that
moves. Needs the index and ~6 GB of disk per CUDA venv; prints one markdown row per version.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# formulas, samplers, the learning tests of the main families and distillation, and every
# family's pipeline equality: what a torch upgrade moves first
SUBSET = ["tests/test_sde_step.py", "tests/test_algos.py", "tests/test_distillation.py", "tests/test_learning.py",
          "tests/test_dmd2.py", "tests/test_qwen_image_edit.py", "tests/test_families.py"]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def try_version(torch_version: str, venvs: Path) -> str:
    venv = venvs / f"torch-{torch_version}"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    start = time.time()
    if not (venv / "bin" / "python").exists():
        run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = run([*pip, "install", "--quiet", f"torch=={torch_version}"])
    if installed.returncode:
        return f"| {torch_version} | install failed: {installed.stderr.strip().splitlines()[-1][:120]} | | | |"
    plan = run([*pip, "install", "--dry-run", "-e", f"{ROOT}[test,ocr]"], cwd=ROOT)
    replaces = [w for w in re.findall(r"\S+", plan.stdout.split("Would install", 1)[-1]) if w.startswith("torch-")]
    kept = "kept" if plan.returncode == 0 and not replaces else f"replaced by {replaces or plan.stderr[-120:]}"
    run([*pip, "install", "--quiet", "-e", f"{ROOT}[test,ocr]"], cwd=ROOT, check=True)
    versions = run([str(venv / "bin" / "python"), "-c", "import torch, diffusers, transformers, peft, ray; "
                    "print(torch.__version__, diffusers.__version__, transformers.__version__, peft.__version__, "
                    "ray.__version__)"], check=True).stdout.split()
    tests = run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET,
                 f"--basetemp={venv}/pytest"], cwd=ROOT)
    summary = (tests.stdout.strip().splitlines() or ["no output"])[-1]
    return (f"| {versions[0]} | `pip install --dry-run -e .`: torch {kept} | {', '.join(versions[1:])} | {summary} | "
            f"{(time.time() - start) / 60:.1f} min |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", default="2.11.0,2.12.1,2.13.0", help="torch versions to try, comma-separated")
    parser.add_argument("--venvs", default="/tmp/pixelrl_versions", help="where the throwaway venvs go")
    args = parser.parse_args()
    venvs = Path(args.venvs)
    venvs.mkdir(parents=True, exist_ok=True)
    print("| torch | install beside it | diffusers, transformers, peft, ray | test subset | wall |")
    print("|---|---|---|---|---|")
    for version in args.torch.split(","):
        print(try_version(version.strip(), venvs), flush=True)


if __name__ == "__main__":
    main()
