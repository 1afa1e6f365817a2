"""`pixelrl` command line.

    pixelrl demo         a short Flow-GRPO run on a tiny model with the JPEG reward
    pixelrl build-tiny   write a tiny random SD3 pipeline folder (offline)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pixelrl.core.quiet import quiet_libraries


DEMO_PROMPTS = [
    "a red circle", "two blue squares", "a cat on a house", "a green tree",
    "a yellow star", "a car in the city", "three purple triangles", "a flower",
]


def cmd_demo(args) -> int:
    import torch

    from pixelrl.core.config import PixelRLConfig
    from pixelrl.models import build_tiny_sd3
    from pixelrl.trainers.in_process import build_engine, build_reward, mean_reward, train_in_process

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_dir = Path(args.run_dir)
    model_dir = run_dir / "tiny_sd3"
    if not (model_dir / "model_index.json").is_file():
        build_tiny_sd3(model_dir, resolution=32, with_vae=False, seed=args.seed)
    cfg = PixelRLConfig(seed=args.seed)
    cfg.model.path = str(model_dir)
    cfg.model.max_sequence_length = 0
    cfg.model.lora_rank, cfg.model.lora_alpha = 8, 16
    cfg.rollout.resolution, cfg.rollout.n, cfg.rollout.num_steps = 32, 4, 6
    cfg.rollout.guidance_scale = 1.0
    cfg.actor.lr = 1e-2
    cfg.data.prompts = DEMO_PROMPTS
    cfg.data.train_batch_size = 4
    cfg.trainer.total_training_steps = args.steps

    engine, reward = build_engine(cfg), build_reward(cfg)
    eval_prompts = DEMO_PROMPTS * 2
    eval_seeds = list(range(10_000, 10_000 + len(eval_prompts)))
    print(f"pixelrl demo: Flow-GRPO on a tiny random SD3 model ({model_dir}), reward = JPEG compressibility "
          f"(-kB at quality 95), {cfg.data.train_batch_size} prompts x {cfg.rollout.n} images per step")
    before = mean_reward(engine, reward, eval_prompts, eval_seeds)
    print(f"fixed-seed eval reward before: {before:.4f}")
    start = time.time()

    def show(step, m):
        print(f"step {step:3d}  reward {m['critic/rewards/mean']:.4f}  (min {m['critic/rewards/min']:.3f} "
              f"max {m['critic/rewards/max']:.3f})  grad_norm {m['actor/grad_norm']:.2e}  "
              f"{m['perf/throughput']:.1f} img/s", flush=True)

    train_in_process(cfg, engine, reward, on_step=show)
    after = mean_reward(engine, reward, eval_prompts, eval_seeds)
    print(f"fixed-seed eval reward after:  {after:.4f}  (change {after - before:+.4f}) "
          f"in {time.time() - start:.0f} s")
    return 0


def cmd_build_tiny(args) -> int:
    from pixelrl.models import build_tiny_sd3

    path = build_tiny_sd3(args.path, resolution=args.resolution, with_vae=not args.no_vae, seed=args.seed)
    print(f"wrote a tiny SD3 pipeline to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pixelrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="short Flow-GRPO run on a tiny model with the JPEG reward")
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--run-dir", default="runs/demo")
    demo.set_defaults(func=cmd_demo)
    tiny = sub.add_parser("build-tiny", help="write a tiny random SD3 pipeline folder")
    tiny.add_argument("path")
    tiny.add_argument("--resolution", type=int, default=32)
    tiny.add_argument("--no-vae", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_build_tiny)
    args = parser.parse_args(argv)
    quiet_libraries()
    from pixelrl.core.errors import PixelRLError

    try:
        return args.func(args)
    except PixelRLError as err:
        print(f"pixelrl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
