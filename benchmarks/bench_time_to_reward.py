"""Time to reward with and without proxy-ranked oversampling (`rollout.oversample`), on the shipped
shapes model, several seeds per arm, one run after another in this process (run it with nothing
else on the machine).

Each arm trains DiffusionNFT (`shapes_nft`, the method whose deterministic sampler the pool's
ranking predicts best, as in the reference) through the regular trainer for the same training-time
budget, with a checkpoint every `--save-every` training seconds; every checkpoint is scored on the
held-out test split (bench_shapes_efficiency.py's training, evaluation and pinned reward). The
table gives, per arm, the mean over seeds of the time and images to the first checkpoint at or
above `--target`, the final and best strict scores, and the oversampling metrics the runs logged.

    python benchmarks/bench_time_to_reward.py --budget 300 --seeds 0 1 2 --out runs/time_to_reward
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_shapes_efficiency import evaluate_run, first_reaching, train

ARMS = {  # name -> (label, overrides)
    "off": ("DiffusionNFT", []),
    "oversample": ("DiffusionNFT + oversample (4x pool, 6 DPM++ steps, best/worst)",
                   ["rollout.oversample.factor=4", "rollout.oversample.num_steps=6", "rollout.oversample.solver=dpm2",
                    "rollout.oversample.keep=best_worst"]),
    "oversample_random": ("DiffusionNFT + 4x pool, kept at random (control)",
                          ["rollout.oversample.factor=4", "rollout.oversample.num_steps=6",
                           "rollout.oversample.keep=random"]),
}


def seed_overrides(seed: int) -> list[str]:
    """Seed 0 is the configs' own; others move the rollout noise, the prompt order and the init."""
    return [] if seed == 0 else [f"rollout.seed={42 + seed}", f"data.seed={1 + seed}", f"seed={seed}"]


def logged_means(run: Path, prefix: str) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for row in rows for k in row if k.startswith(prefix)}
    return {k: statistics.fmean(row[k] for row in rows if k in row) for k in sorted(keys)}


def plot(curves: dict[str, dict[int, list[dict]]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=120)
    for (arm, runs), color in zip(curves.items(), ("C0", "C1", "C2")):
        for i, points in enumerate(runs.values()):
            ax.plot([p["seconds"] / 60 for p in points], [p["strict"] for p in points], color=color, marker="o",
                    ms=3, alpha=0.8, label=ARMS[arm][0] if i == 0 else None)
    ax.axhline(target, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("training minutes (2-core CPU)")
    ax.set_ylabel("held-out strict score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["off", "oversample"], choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=300.0, help="training seconds per run")
    parser.add_argument("--save-every", type=float, default=60.0, help="checkpoint spacing in training seconds")
    parser.add_argument("--per-category", type=int, default=64, help="held-out items per category")
    parser.add_argument("--target", type=float, default=0.607, help="held-out strict score to reach")
    parser.add_argument("--out", type=Path, default=Path("runs/time_to_reward"))
    args = parser.parse_args()
    import torch

    from pixelrl.core.quiet import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(2)
    started = time.time()
    curves: dict[str, dict[int, list[dict]]] = {arm: {} for arm in args.arms}
    runs: dict[str, dict[int, Path]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:  # seeds outermost: a drift of the machine's speed hits every arm alike
        for arm in args.arms:
            run = train("nft", args.out / f"{arm}_seed{seed}", args.budget, args.save_every,
                        ARMS[arm][1] + seed_overrides(seed))
            runs[arm][seed], curves[arm][seed] = run, evaluate_run("nft", run, args.per_category)
            print(f"# {arm} seed {seed} done ({(time.time() - started) / 60:.1f} min so far)", flush=True)
    print(f"# shapes model, shapes_nft, 8 prompts x 8 kept images per step, budget {args.budget:.0f} training s per "
          f"run, held-out test {6 * args.per_category} images, target strict {args.target:.3f}, seeds {args.seeds}")
    print("| arm | steps (mean) | s/step | first >= target: s (each seed) | images | strict final (mean) | best (mean) "
          "| proxy-exact corr | kept / pool group std |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in args.arms:
        points = list(curves[arm].values())
        hits = [first_reaching(p, args.target) for p in points]
        reach = ", ".join(f"{h['seconds']:.0f}" if h else "-" for h in hits)
        images = ", ".join(str(h["images"]) if h else "-" for h in hits)
        logged = [logged_means(runs[arm][s], "") for s in args.seeds]
        steps = statistics.fmean(p[-1]["step"] for p in points)
        s_per_step = statistics.fmean(m["timing_s/step"] for m in logged)
        corr = [m["oversample/proxy_exact_corr"] for m in logged if "oversample/proxy_exact_corr" in m]
        spread = [m["oversample/kept_group_std"] / m["oversample/pool_group_std"] for m in logged
                  if "oversample/pool_group_std" in m]
        print(f"| {ARMS[arm][0]} | {steps:.0f} | {s_per_step:.1f} | {reach} | {images} | "
              f"{statistics.fmean(p[-1]['strict'] for p in points):.3f} | "
              f"{statistics.fmean(max(q['strict'] for q in p) for p in points):.3f} | "
              f"{f'{statistics.fmean(corr):.2f}' if corr else '-'} | "
              f"{f'{statistics.fmean(spread):.2f}' if spread else '-'} |")
    base = statistics.fmean(p[0]["strict"] for runs_of in curves.values() for p in runs_of.values())
    print(f"base strict {base:.3f}")
    plot(curves, args.out / "time_to_reward.png", args.target)
    (args.out / "time_to_reward.json").write_text(json.dumps({a: {str(s): c for s, c in v.items()}
                                                              for a, v in curves.items()}, indent=1))
    print(f"wrote {args.out / 'time_to_reward.png'} and {args.out / 'time_to_reward.json'}")


if __name__ == "__main__":
    main()
