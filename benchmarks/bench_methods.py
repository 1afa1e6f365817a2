"""What each policy-gradient option costs, on the tiny model with the same batch.

Flow-GRPO with the full window vs Flow-GRPO-Fast (W = 2) vs MixGRPO (W = 2), and bypass vs
decoupled rollout correction, all through the trainer (one in-process worker).

    python benchmarks/bench_methods.py --steps 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import train_and_measure  # noqa: E402

VARIANTS = [
    ("Flow-GRPO, full window (9 of 10 steps), bypass", "flow_grpo_tiny", []),
    ("Flow-GRPO-Fast, W=2 in [0, 6)", "flow_grpo_tiny", ["rollout.sde_window_size=2", "rollout.sde_window_range=[0,6]"]),
    ("MixGRPO, W=2, progressive", "mixgrpo_tiny", []),
    ("Flow-GRPO, full window, decoupled", "flow_grpo_tiny", ["algorithm.rollout_correction=decoupled"]),
    ("Flow-GRPO-Fast W=2, decoupled", "flow_grpo_tiny", ["rollout.sde_window_size=2", "rollout.sde_window_range=[0,6]",
                                                        "algorithm.rollout_correction=decoupled"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from pixelrl.core.quiet import quiet_libraries
    from pixelrl.models import build_tiny_sd3

    quiet_libraries()
    torch.set_num_threads(args.threads)
    common = ["trainer.backend=local", f"trainer.total_training_steps={args.steps}", "rollout.num_steps=10",
              "data.train_batch_size=4", "rollout.n=4", "actor.ppo_micro_batch_size=8", "rollout.micro_batch_size=16"]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_sd3(Path(tmp) / "tiny", resolution=32, with_vae=False, with_t5=False)
        print(f"# tiny SD3 (pixel space, 32 px, LoRA r8), 4 prompts x 4 images, 10 sampling steps, "
              f"{args.threads} threads, one in-process worker, {args.steps - 1} timed steps after 1 warm-up")
        print("| variant | s/step | images/s | gen s | old_log_prob s | update s |")
        print("|---|---|---|---|---|---|")
        for i, (name, config, overrides) in enumerate(VARIANTS):
            r = train_and_measure(config, model, Path(tmp) / "runs", f"v{i}", [*common, *overrides])
            p = r["phases"]
            print(f"| {name} | {r['step_s']:.3f} | {r['img_s']:.1f} | {p.get('gen', 0):.3f} "
                  f"| {p.get('old_log_prob', 0):.3f} | {p.get('update_actor', 0):.3f} |", flush=True)


if __name__ == "__main__":
    main()
