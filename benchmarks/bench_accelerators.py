"""What a lossy rollout accelerator buys and costs on the shipped shapes model: the demo's rollout
batch (8 prompts x 8 images, its sampler: 10 Euler steps, SDE on steps 1-5, no CFG), sampled with
each accelerator setting from the same seeds, timed (the median of `--repeats` calls, after one
warm-up) and scored with the demo's reward (exact scene) beside the plain sampler's images.

    python benchmarks/bench_accelerators.py --thresholds 0.05 0.1 0.2 0.3 --batches 4

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="shapes_demo")
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--batches", type=int, default=4, help="rollout batches (training steps' prompts) per setting")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch (the median is kept)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides")
    args = parser.parse_args()
    import torch

    from pixelrl.config import load_config
    from pixelrl.core.quiet import quiet_libraries
    from pixelrl.engine import PolicyEngine
    from pixelrl.rewards import WeightedReward
    from pixelrl.trainers.datasets import datasets_of
    from pixelrl.trainers.step import plan_rollout

    quiet_libraries()
    torch.set_num_threads(2)
    cfg = load_config(args.config, ["trainer.backend=local", "trainer.n_workers=1", *args.set])
    engine = PolicyEngine.from_config(cfg, trains=False)
    reward = WeightedReward.from_functions(cfg.reward.functions)
    train, _ = datasets_of(cfg)
    rows = train.rows[: cfg.data.train_batch_size * args.batches]
    settings = {"none": engine.settings}
    for threshold in args.thresholds:
        settings[f"first_block_cache {threshold:g}"] = dataclasses.replace(
            engine.settings, accelerator="first_block_cache", accelerator_params={"threshold": threshold})
    exact_images = {}
    print(f"# {args.config}: {args.batches} batches of {cfg.data.train_batch_size} prompts x {cfg.rollout.n} images, "
          f"{cfg.rollout.num_steps} steps, micro-batch {cfg.rollout.micro_batch_size}, torch threads 2")
    print("| accelerator | s per batch | speed-up | forwards skipped | reward (exact scene) | reward, plain sampler "
          "| mean abs pixel change |")
    print("|---|---|---|---|---|---|---|")
    base_seconds = None
    for name, chosen in settings.items():
        seconds, rewards, plain, changes, skipped, forwards = [], [], [], [], 0, 0
        for b in range(args.batches):
            part = rows[b * cfg.data.train_batch_size:(b + 1) * cfg.data.train_batch_size]
            request, window = plan_rollout([r["prompt"] for r in part], [r.get("metadata", {}) for r in part], b + 1,
                                           cfg, uids=[str(i) for i in range(len(part))])
            sample = lambda: engine.rollout(request["prompts"], request["seeds"], window=window, settings=chosen)
            sample()  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                batch = sample()
                times.append(time.perf_counter() - start)
            seconds.append(statistics.median(times))
            counts = batch.info["accelerated"]
            skipped, forwards = skipped + counts.get("skipped", 0), forwards + counts.get("forwards", 0)
            score = reward(batch["images"], request["prompts"], request["metadata"])["overall"]
            rewards.append(float(score.mean()))
            exact_images.setdefault(b, batch["images"])
            plain.append(float(reward(exact_images[b], request["prompts"], request["metadata"])["overall"].mean()))
            changes.append(float((batch["images"].float() - exact_images[b].float()).abs().mean()))
        mean_s = statistics.fmean(seconds)
        base_seconds = base_seconds or mean_s
        print(f"| {name} | {mean_s:.2f} | {base_seconds / mean_s:.2f}x | "
              f"{skipped / forwards if forwards else 0:.0%} | {statistics.fmean(rewards):.3f} | "
              f"{statistics.fmean(plain):.3f} | {statistics.fmean(changes):.1f} of 255 |")


if __name__ == "__main__":
    main()
