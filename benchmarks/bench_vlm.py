"""The vision-language trainer on two CPU cores: samples/s, tokens/s, time per phase, peak memory.

Each configuration runs in its own process (so peak RSS is its own) on the shipped shapes-QA
model, through the trainer: `--steps` steps after one warm-up step, GRPO (group_norm, no critic)
and PPO with a critic (gae), at two batch sizes, with 1 and 2 PPO epochs, and on 2 Ray workers
(DDP and FSDP2, one thread each) against one process with 2 threads, and with PPO's old
log-probs taken from sampling instead of a scoring forward. Counts are per rank and
step (a rank runs its share of the batch). Forwards and backwards per step are
counted from the schedule: generation runs one forward per new token over the batch; scoring
runs the old-policy forward (+ reference, + critic); each micro-batch of an update runs one
forward and one backward of the actor (+ the critic).

    python benchmarks/bench_vlm.py            # ~1-2 min on 2 cores
    python benchmarks/bench_vlm.py --only "GRPO 32x8" "GRPO 32x8, old log-probs from sampling"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import mib  # noqa: E402

# One process with 2 threads (RAY overrides it), and PPO's old log-probs from a scoring forward as
# verl and LightRFT take them (the shipped config reuses the sampler's; one row measures that)
MEASURED = ["trainer.backend=local", "trainer.n_workers=1", "vlm.recompute_old_logp=true"]
BASE = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size=64", *MEASURED]
BIG = ["data.train_batch_size=32", "actor.ppo_mini_batch_size=128", "actor.ppo_micro_batch_size=64", *MEASURED]
RAY = ["trainer.backend=ray", "trainer.n_workers=2", "trainer.num_cpus_per_worker=1"]
CONFIGS = {
    "GRPO 16x8": BASE,
    "GRPO 32x8": BIG,
    "GRPO 32x8, old log-probs from sampling": BIG + ["vlm.recompute_old_logp=false"],
    "GRPO 16x8, 2 epochs": BASE + ["actor.ppo_epochs=2"],
    "PPO+critic (gae) 16x8": BASE + ["vlm.estimator=gae"],
    "GRPO 16x8 + KL (ref)": BASE + ["vlm.kl_coef=0.01"],
    "GRPO 32x8, 2 workers DDP": BIG + RAY,
    "GRPO 32x8, 2 workers FSDP2": BIG + RAY + ["trainer.strategy=fsdp2"],
}


def run_one(overrides: list[str], steps: int) -> dict:
    """`steps` + 1 trainer steps (no validation, no checkpoints); the first is warm-up."""
    import tempfile

    import torch

    from pixelrl.config import load_config
    from pixelrl.vlm.trainer import VLMPPOTrainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("vlm_grpo_shapes_qa", [
            f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps + 1}", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]", *overrides])
        workers = cfg.trainer.n_workers if cfg.trainer.backend == "ray" else 1
        torch.set_num_threads(2 // workers)
        rows = VLMPPOTrainer(cfg, console=lambda line: None).fit()["history"][1:]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith(("timing_s/", "response/"))}
    samples = cfg.data.train_batch_size * cfg.rollout.n
    micro = min(cfg.actor.ppo_micro_batch_size, (cfg.actor.ppo_mini_batch_size or samples) // workers)
    batches = -(-samples // workers // micro)  # micro-batches per rank
    update_passes = cfg.actor.ppo_epochs * batches
    scoring = int(cfg.vlm.recompute_old_logp) + (cfg.vlm.kl_coef > 0) + (cfg.vlm.estimator == "gae")
    critic = 1 + (cfg.vlm.estimator == "gae")
    return {
        "samples/s": samples / mean["timing_s/step"],
        # metrics are means over ranks: a rank's tokens times the ranks
        "tokens/s": mean["response/sequence_tokens"] * workers / mean["timing_s/step"],
        "step_s": mean["timing_s/step"],
        "generate_s": mean["timing_s/generate"], "reward_s": mean["timing_s/reward"],
        "score_s": mean["timing_s/score"], "train_s": mean["timing_s/train"],
        "forwards/step": f"{cfg.vlm.max_new_tokens} gen + {scoring} x {batches} score + {update_passes * critic} train",
        "backwards/step": update_passes * critic,
        # each worker's own peak (its perf/peak_memory_gb), the mean over workers
        "peak_rss_mb": mib(rows[-1]["perf/peak_memory_gb"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="run only the configs with these names")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one), args.steps)))
        return
    print(f"shipped shapes-QA Qwen2-VL (0.62M parameters), full fine-tuning, 2 cores (one process x 2 threads, or "
          f"2 workers x 1 thread), {args.steps} timed steps after 1 warm-up, max_new_tokens 4, micro-batch 64")
    header = "| config | samples/s | tokens/s | step s | generate s | reward s | score s | train s | forwards / step | backwards / step | peak RSS MB |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for name, overrides in CONFIGS.items():
        if args.only is not None and name not in args.only:
            continue
        out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", json.dumps(overrides)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['samples/s']:.1f} | {r['tokens/s']:.0f} | {r['step_s']:.2f} | {r['generate_s']:.2f} | "
              f"{r['reward_s']:.3f} | {r['score_s']:.2f} | {r['train_s']:.2f} | {r['forwards/step']} | "
              f"{r['backwards/step']} | {r['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
