"""Throughput of the Ray runtime with 1 and 2 actor workers, same per-worker batch.

Runs `pixelrl train` on a tiny SD3 model (built offline) for a few steps per setting and
reads the per-step metrics the trainer logs; the first step (warm-up) is excluded.

    python benchmarks/bench_workers.py                    # ddp, 1 and 2 workers
    python benchmarks/bench_workers.py --strategies ddp fsdp2 --steps 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import train_and_measure  # noqa: E402


def run(model: Path, out: Path, workers: int, strategy: str, steps: int, prompts_per_worker: int, n: int,
        threads: int) -> dict:
    r = train_and_measure("flow_grpo_tiny", model, out, f"w{workers}_{strategy}", [
        f"trainer.n_workers={workers}", f"trainer.strategy={strategy}", f"trainer.num_cpus_per_worker={threads}",
        f"trainer.total_training_steps={steps}", f"data.train_batch_size={prompts_per_worker * workers}",
        f"rollout.n={n}", "rollout.num_steps=10"])
    return {"workers": workers, "strategy": strategy, "images_per_step": r["images"], "step_s": r["step_s"],
            "img_s": r["img_s"], "img_s_per_worker": r["img_s"] / workers,
            **{f"{p}_s": r["phases"].get(p, 0.0) for p in ("gen", "reward", "update_actor")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["ddp"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-worker", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="CPU cores (torch threads) per worker")
    args = parser.parse_args()
    import ray

    from pixelrl.core.quiet import quiet_libraries
    from pixelrl.workers.local_ray import start_local_ray
    from pixelrl.models import build_tiny_sd3

    quiet_libraries()
    start_local_ray(os.cpu_count() or 1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build_tiny_sd3(Path(tmp) / "tiny", resolution=32, with_vae=False, with_t5=False)
            print(f"# tiny SD3 (pixel space, 32 px, LoRA r8), 10 sampling steps, full window, "
                  f"{args.prompts_per_worker} prompts x {args.n} images per worker, {args.threads} core(s) per worker, "
                  f"{args.steps - 1} timed steps after 1 warm-up")
            print("| workers | strategy | images/step | s/step | images/s | images/s per worker | gen s | reward s | update s |")
            print("|---|---|---|---|---|---|---|---|---|")
            for strategy in args.strategies:
                for workers in (1, 2):
                    r = run(model, Path(tmp) / "runs", workers, strategy, args.steps, args.prompts_per_worker,
                            args.n, args.threads)
                    print(f"| {workers} | {strategy} | {r['images_per_step']} | {r['step_s']:.2f} | {r['img_s']:.1f} "
                          f"| {r['img_s_per_worker']:.1f} | {r['gen_s']:.2f} | {r['reward_s']:.3f} "
                          f"| {r['update_actor_s']:.2f} |", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
