"""The spread of every learning test's gain over CPU kernels and thread counts.

A learning test passes when training beats the untrained score by a margin; the same run on
another CPU takes other float kernels (AVX2 or AVX-512 matmuls, another reduction order) and
ends elsewhere. This runs the `learning` tests once per (kernel set, thread count), reads the
scores each test records (conftest.record_learning), and prints each test's gains, the smallest
one and its margin. A margin must stay below the smallest gain with room to spare.

    python tests/learning_spread.py                         # the default run's learning tests
    python tests/learning_spread.py --slow                  # the slow ones too
    python tests/learning_spread.py -k dgpo --kernels avx2  # one test, one kernel set

ATEN_CPU_CAPABILITY makes torch dispatch to the kernels of a lesser CPU than this one (default:
no vector extensions; avx2; avx512): a capability this CPU lacks falls back to the best it has.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(kernels: str, threads: int, selection: list[str], log: Path) -> int:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernels, "PIXELRL_TEST_THREADS": str(threads),
           "PIXELRL_LEARNING_LOG": str(log)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=["default", "avx2", "avx512"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--slow", action="store_true", help="the slow learning tests too")
    parser.add_argument("-k", default=None, help="pytest's -k expression")
    args = parser.parse_args(argv)
    selection = ["-m", "learning" if args.slow else "learning and not slow"] + (["-k", args.k] if args.k else [])
    gains: dict[str, dict[str, float]] = defaultdict(dict)
    margins: dict[str, float | None] = {}
    settings = [f"{k}/{t}" for k in args.kernels for t in args.threads]
    with tempfile.TemporaryDirectory() as scratch:
        for kernels in args.kernels:
            for threads in args.threads:
                log = Path(scratch) / f"{kernels}_{threads}.jsonl"
                code = run(kernels, threads, selection, log)
                rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
                for row in rows:
                    gains[row["test"]][f"{kernels}/{threads}"] = row["after"] - row["before"]
                    margins[row["test"]] = row["margin"]
                print(f"# {kernels}/{threads}: pytest exit {code}, {len(rows)} tests recorded", file=sys.stderr)
    print("| test | " + " | ".join(settings) + " | smallest | margin |")
    print("|---|" + "---|" * (len(settings) + 2))
    for test in sorted(gains):
        row = gains[test]
        margin = margins[test]
        cells = [f"{row[s]:+.3f}" if s in row else "-" for s in settings]
        print(f"| {test.split('::', 1)[1]} | " + " | ".join(cells) + f" | {min(row.values()):+.3f} | "
              + (f"{margin:.3f}" if margin is not None else "(a level)") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
