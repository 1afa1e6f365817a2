"""Operators dispatched per phase of a training step: on a CPU, the count of kernels the same step
launches on a GPU, which is what sets the speed of a small model's step there.

A step of the shapes model on an H100/H200 is bound by launches, not arithmetic (MFU ~0.02): the
GPU waits on the host's ~25 us per operator. Counting the operators here predicts how a change
(a larger micro-batch, a fused kernel, fewer per-tensor checks) moves that step before a GPU is
at hand. Each `--case` runs `pixelrl train` in this process on one local worker for `--steps`
steps and counts, in the last step, every operator that reaches a kernel (views, reshapes and
allocations are left out: they launch nothing) in the engine's rollout and update. Two counts
differ from a GPU's by design: AdamW runs nine operators per trained tensor here and a few
`foreach` launches for all of them on CUDA, and the attention is one CPU operator where CUDA may
launch two.

    python benchmarks/bench_launches.py --config shapes_demo \\
        --case "micro 32=actor.ppo_micro_batch_size=32" --case "micro 64=actor.ppo_micro_batch_size=64"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators that only describe memory (or allocate it): no kernel runs for them
LAUNCH_FREE = frozenset({
    "view", "_unsafe_view", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "slice",
    "select", "detach", "alias", "reshape", "split", "chunk", "unbind", "split_with_sizes", "empty", "empty_strided",
    "_reshape_alias", "lift_fresh", "narrow", "unflatten", "flatten", "_local_scalar_dense"})
PHASES = ("rollout", "update")


class OperatorCount(TorchDispatchMode):
    """Counts the operators that launch a kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in LAUNCH_FREE:
            self.by_name[name] += 1
        return func(*args, **(kwargs or {}))


def count_case(config: str, overrides: list[str], steps: int) -> dict[str, Counter]:
    """{phase: operator counts} of the last of `steps` training steps."""
    from pixelrl.cli import main
    from pixelrl.engine.policy_engine import PolicyEngine

    last: dict[str, Counter] = {}
    originals = {phase: getattr(PolicyEngine, phase) for phase in PHASES}

    def counted(phase):
        def run(self, *args, **kwargs):
            with OperatorCount() as count:
                out = originals[phase](self, *args, **kwargs)
            last[phase] = count.by_name
            return out
        return run

    for phase in PHASES:
        setattr(PolicyEngine, phase, counted(phase))
    try:
        with tempfile.TemporaryDirectory() as folder:
            code = main(["train", "--config-name", config, "trainer.backend=local", "trainer.n_workers=1",
                         f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
                         "trainer.logger=[console]", f"trainer.default_local_dir={folder}", *overrides])
    finally:
        for phase, original in originals.items():
            setattr(PolicyEngine, phase, original)
    if code:
        raise SystemExit(f"pixelrl train exited with {code} on {config} {' '.join(overrides)}")
    return last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="shapes_demo")
    parser.add_argument("--case", action="append", default=[],
                        help="'label=override override ...' (repeatable); default: the config as written")
    parser.add_argument("--steps", type=int, default=2, help="steps to run; the last is counted")
    parser.add_argument("--top", type=int, default=8, help="the most frequent operators to list per phase")
    args = parser.parse_args(argv)
    cases = [case.partition("=") for case in args.case] or [("as written", "=", "")]
    rows = []
    for label, _, overrides in cases:
        counts = count_case(args.config, overrides.split(), args.steps)
        rows.append((label, overrides, counts))
    print(f"\noperators dispatched in step {args.steps} of `{args.config}` (one local worker, torch {torch.__version__})\n")
    print("| case | overrides | " + " | ".join(PHASES) + " | total |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for label, overrides, counts in rows:
        totals = [sum(counts.get(phase, Counter()).values()) for phase in PHASES]
        print(f"| {label} | `{overrides or '-'}` | " + " | ".join(f"{n:,}" for n in totals) + f" | {sum(totals):,} |")
    for label, _, counts in rows:
        for phase in PHASES:
            top = ", ".join(f"{name} {n}" for name, n in counts.get(phase, Counter()).most_common(args.top))
            print(f"\n{label}, {phase}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
