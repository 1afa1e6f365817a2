"""Synchronous vs one-step-off vs bounded-staleness (async) training on two CPU cores.

Three layouts of the same two cores, each with a plain reward (JPEG size, milliseconds) and with
a reward that takes about as long as generating the batch (`delayed`: a scorer served elsewhere,
holding no CPU here):

- sync: 2 colocated actor workers that sample, then train (1 core each);
- one_step_off: 1 actor worker + 1 rollout worker, batch i + 1 sampled while batch i trains;
- async k=2: the same pool sampling up to two steps ahead.

Every number comes from the per-step wall-clock timestamps the trainer logs (timeline/*); the
first `--warmup` steps are excluded.

    python benchmarks/bench_async.py --plot docs/async_timeline.png   # ~10 min on 2 cores
    python benchmarks/bench_async.py --override rollout.sde_window_size=3 rollout.sde_window_range=[0,5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

LAYOUTS = {
    "sync (2 colocated)": ["trainer.n_workers=2", "trainer.mode=sync"],
    "one_step_off (1+1)": ["trainer.n_workers=1", "rollout.n_workers=1", "trainer.mode=one_step_off"],
    "async k=2 (1+1)": ["trainer.n_workers=1", "rollout.n_workers=1", "trainer.mode=async", "trainer.max_staleness=2"],
}


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals`, clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, end = 0.0, -np.inf
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def intersection_length(first, second, lo, hi) -> float:
    pairs = [(max(a, c), min(b, d)) for a, b in first for c, d in second if min(b, d) > max(a, c)]
    return union_length(pairs, lo, hi)


def summarise(rows: list[dict], warmup: int, colocated: bool, images_per_step: int) -> dict:
    """Throughput and busy/idle fractions over the steps after `warmup`, from timeline/*."""
    timed = rows[warmup:]
    lo, hi = rows[warmup - 1]["timeline/train_end"], timed[-1]["timeline/train_end"]
    wall = hi - lo
    images = images_per_step * len(timed)
    gen = [(r["timeline/gen_start"], r["timeline/gen_end"]) for r in rows]
    train = [(r["timeline/train_start"], r["timeline/train_end"]) for r in rows]
    reward = [(r["timeline/reward_start"], r["timeline/reward_end"]) for r in rows]
    actor_busy = union_length(train + (gen if colocated else []), lo, hi)
    return {
        "img_s": images / wall,
        "step_s": wall / len(timed),
        "overlap": intersection_length(gen, train, lo, hi) / wall,
        "reward_hidden": intersection_length(reward, gen + train, lo, hi) / max(union_length(reward, lo, hi), 1e-9),
        "actor_idle": 1 - actor_busy / wall,
        "rollout_idle": None if colocated else 1 - union_length(gen, lo, hi) / wall,
        "staleness": float(np.mean([r["training/staleness"] for r in timed])),
        "gen_s": float(np.mean([b - a for a, b in gen[warmup:]])),
        "reward_s": float(np.mean([b - a for a, b in reward[warmup:]])),
        "train_s": float(np.mean([b - a for a, b in train[warmup:]])),
    }


def run(model: Path, out: Path, name: str, layout: list[str], reward: list[str], args) -> dict:
    from pixelrl.cli import main

    experiment = "".join(c if c.isalnum() else "_" for c in name)
    code = main(["train", "--config-name", "flow_grpo_tiny", f"model.path={model}", f"trainer.default_local_dir={out}",
                 f"trainer.experiment_name={experiment}", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 "trainer.num_cpus_per_worker=1", "rollout.num_cpus_per_worker=1",
                 f"trainer.total_training_steps={args.steps}", f"data.train_batch_size={args.prompts}",
                 f"rollout.n={args.n}", f"rollout.num_steps={args.num_steps}", f"rollout.resolution={args.resolution}",
                 f"actor.ppo_mini_batch_size={args.prompts * args.n}", *args.override, *layout, *reward])
    if code != 0:
        raise SystemExit(f"training failed: {name}")
    rows = [json.loads(line) for line in (out / "pixelrl" / experiment / "metrics.jsonl").read_text().splitlines()]
    return rows, summarise(rows, args.warmup, colocated="rollout.n_workers=1" not in layout,
                           images_per_step=args.prompts * args.n)


def plot_timelines(runs: dict[str, list[dict]], path: Path, steps: int = 4) -> None:
    """One panel per layout: when sampling, scoring and training of each batch ran (first
    `steps` batches after warm-up), from the run's own timeline/* metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.3 + 1.1 * len(runs)), dpi=120, sharex=True)
    lanes = [("train", "actor: train", "tab:blue"), ("reward", "reward", "tab:green"),
             ("gen", "sampling", "tab:orange")]
    for ax, (name, rows) in zip(axes, runs.items()):
        shown = rows[2:2 + steps]
        origin = min(min(r["timeline/gen_start"], r["timeline/train_start"]) for r in shown)
        for lane, (phase, label, color) in enumerate(lanes):
            bars = [(r[f"timeline/{phase}_start"] - origin, r[f"timeline/{phase}_end"] - r[f"timeline/{phase}_start"])
                    for r in shown]
            ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=color, edgecolors="white")
            for r, (start, width) in zip(shown, bars):
                ax.text(start + width / 2, lane, str(int(r["training/global_step"])), ha="center", va="center", fontsize=7,
                        color="white")
        ax.set_yticks(range(len(lanes)), [label for _, label, _ in lanes], fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[-1].set_xlabel("seconds (numbers: the batch / training step)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=10, help="sampling steps")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--override", nargs="*", default=[], help="more config overrides for every run, e.g. "
                        "rollout.sde_window_size=3 (Flow-GRPO-Fast: fewer trained steps)")
    parser.add_argument("--plot", default="", help="write the slow-reward timelines to this PNG")
    args = parser.parse_args()
    import ray

    from pixelrl.core.quiet import quiet_libraries
    from pixelrl.workers.local_ray import start_local_ray
    from pixelrl.models import build_tiny_sd3

    quiet_libraries()
    start_local_ray(2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build_tiny_sd3(Path(tmp) / "tiny", resolution=args.resolution, with_vae=False, with_t5=False)
            runs = Path(tmp) / "runs"
            images = args.prompts * args.n
            plain = ["reward.functions=[{name: jpeg_compressibility, weight: 1.0}]"]
            # calibrate the slow reward: as long as one worker takes to sample a batch on one core
            _, sync = run(model, runs, "calibration", LAYOUTS["one_step_off (1+1)"], plain, args)
            per_image = round(sync["gen_s"] / images, 4)
            slow = [f"reward.functions=[{{name: delayed, weight: 1.0, options: {{reward: jpeg_compressibility, "
                    f"seconds_per_image: {per_image}}}}}]"]
            print(f"# tiny SD3 (pixel space, {args.resolution} px, LoRA r8), {args.num_steps} sampling steps, "
                  f"overrides {args.override or 'none'}, "
                  f"{args.prompts} prompts x {args.n} images per step, 2 cores (1 per worker), "
                  f"{args.steps - args.warmup} timed steps after {args.warmup} warm-up; slow reward: "
                  f"{per_image} s per image ({per_image * images:.1f} s a batch = one batch's sampling on one core)")
            print("| layout | reward | images/s | s/step | gen s | reward s | train s | rollout-train overlap "
                  "| reward hidden | actor idle | rollout pool idle | mean staleness |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            timelines = {}
            for reward_name, reward in (("plain", plain), ("slow", slow)):
                for name, layout in LAYOUTS.items():
                    rows, r = run(model, runs, f"{name}_{reward_name}", layout, reward, args)
                    if reward_name == "slow":
                        timelines[f"{name}, slow reward"] = rows
                    pool_idle = "-" if r["rollout_idle"] is None else f"{r['rollout_idle']:.0%}"
                    print(f"| {name} | {reward_name} | {r['img_s']:.2f} | {r['step_s']:.2f} | {r['gen_s']:.2f} "
                          f"| {r['reward_s']:.2f} | {r['train_s']:.2f} | {r['overlap']:.0%} | {r['reward_hidden']:.0%} "
                          f"| {r['actor_idle']:.0%} | {pool_idle} | {r['staleness']:.2f} |", flush=True)
            if args.plot:
                plot_timelines(timelines, Path(args.plot))
                print(f"timeline: {args.plot}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
