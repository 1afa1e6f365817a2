"""Start-up of `pixelrl` commands that load no model: wall seconds from launch to exit, each
command run `--repeat` times in a fresh interpreter (the median printed), and which of the heavy
libraries the command imported.

    python benchmarks/bench_startup.py                       # --help, config, plan
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/bench_startup.py   # another commit
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "--help": ["--help"],
    "config": ["config", "--config-name", "shapes_demo"],
    "plan": ["plan", "--config-name", "shapes_demo", "--gpus", "1", "--gpu-memory", "80"],
}
HEAVY = ("torch", "diffusers", "transformers", "torch._dynamo", "ray", "peft")
RUN = """
import sys
from pixelrl.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("imported:", ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {args.repeat} runs each, median wall seconds")
    print("| command | wall s | heavy libraries imported |")
    print("|---|---|---|")
    for name, argv in COMMANDS.items():
        times, imported = [], ""
        for _ in range(args.repeat):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", RUN.format(heavy=HEAVY), *argv], capture_output=True,
                                  text=True)
            times.append(time.perf_counter() - start)
            imported = next((line.split(":", 1)[1].strip() for line in done.stderr.splitlines()
                             if line.startswith("imported:")), "?")
        print(f"| `pixelrl {' '.join(argv)}` | {statistics.median(times):.2f} | {imported or 'none'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
