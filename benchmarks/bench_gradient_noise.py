"""How many images a policy-gradient step needs before it is more signal than noise: the gradient
noise scale B_noise (pixelrl.shapes.gradient_noise) of a config at its starting weights.

K batches of the config's size (different prompts and seeds, as K training steps would draw them)
are sampled, scored and turned into a gradient by the trainer's own step (`make_rollout` and the
config's consumer), but the optimizer never steps, so all K gradients are taken at the same
weights. Prints |G|^2 with its jackknife standard error, tr S, B_noise in images and its lower
bound, the minutes this machine takes to sample that many images in training steps, and the mean
cosine between two batches' gradients. Run it with nothing else on the machine (one process, all
cores).

    python benchmarks/bench_gradient_noise.py                                # the Flow-GRPO demo config
    python benchmarks/bench_gradient_noise.py --batches 12
    python benchmarks/bench_gradient_noise.py --config shapes_awm
"""

from __future__ import annotations

import argparse
import time

import torch


def batch_gradients(config: str, overrides: list[str], batches: int) -> dict:
    """K gradients at the starting weights: `grads`, `images` per batch, mean `batch_s` and
    `reward`, and the `engine` (its weights as they started)."""
    from pixelrl.engine.config import optimizer_steps_per_rollout
    from pixelrl.config import load_config
    from pixelrl.data.prompts import collate_rows
    from pixelrl.engine.policy_engine import PolicyEngine
    from pixelrl.rewards.multi import WeightedReward
    from pixelrl.trainers.consumers import CONSUMERS
    from pixelrl.trainers.controller import datasets_of
    from pixelrl.trainers.step import make_rollout

    cfg = load_config(config, ["trainer.backend=local", "trainer.n_workers=1", "algorithm.drop_zero_advantage=false",
                               *overrides])
    if cfg.algorithm.sample_source != "online":
        raise SystemExit("the noise scale is measured on online samples; offline preference pairs are not sampled")
    if optimizer_steps_per_rollout(cfg) != 1:
        raise SystemExit(f"the config takes {optimizer_steps_per_rollout(cfg)} optimizer steps per batch; measure with "
                         "actor.ppo_mini_batch_size=0 actor.ppo_epochs=1 (one gradient per batch)")
    consume = CONSUMERS.get(cfg.algorithm.trainer_type).update  # Flow-GRPO's update, or the forward-process methods'
    engine = PolicyEngine.from_config(cfg)
    reward = WeightedReward.from_functions([dict(f) for f in cfg.reward.functions])
    rows = datasets_of(cfg)[0]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.data.seed)).tolist()
    per_batch = cfg.data.train_batch_size
    if batches * per_batch > len(rows):
        raise SystemExit(f"{batches} batches of {per_batch} prompts need {batches * per_batch} prompts; "
                         f"the training set has {len(rows)}")
    grads: list[torch.Tensor] = []
    learner = engine.learner

    def keep_gradient(loss_total: float) -> dict[str, float]:
        # instead of the optimizer step: record the accumulated gradient, leave the weights alone
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).clone()
                                for p in learner.params]))
        learner.zero_grad()
        return {"stepped": 0.0}

    learner.step = keep_gradient
    seconds, rewards, images = [], [], 0
    for k in range(batches):
        chunk = collate_rows([rows[i] for i in order[k * per_batch:(k + 1) * per_batch]])
        start = time.perf_counter()
        rollout = make_rollout(engine, reward, chunk["prompts"], chunk["metadata"], k + 1, cfg)
        consume(engine, rollout, cfg)
        seconds.append(time.perf_counter() - start)
        rewards.append(float(rollout.scores["overall"].mean()))
        images = len(rollout.batch)
    return {"grads": grads, "images": images, "batch_s": sum(seconds) / len(seconds),
            "reward": sum(rewards) / len(rewards), "engine": engine}


def main() -> None:
    from pixelrl.shapes.gradient_noise import gradient_noise_scale

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="shapes_demo_flow_grpo")
    parser.add_argument("--batches", type=int, default=8, help="K gradients (K >= 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable)")
    args = parser.parse_args()
    measured = batch_gradients(args.config, args.set, args.batches)
    images, batch_s, reward = measured["images"], measured["batch_s"], measured["reward"]
    out = gradient_noise_scale(measured["grads"], samples_per_grad=images)
    lower = out.get("noise_scale_lower", float("nan"))
    print(f"config {args.config} {' '.join(args.set)}; {args.batches} batches of {images} images at the starting "
          f"weights; mean training reward {reward:.3f}; {batch_s:.1f} s per batch")
    print("| images / batch | |G|^2 [+- se] | tr S | B_noise (images) | B_noise lower bound (images) | "
          "minutes to sample the bound | cosine of two batches' gradients |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {images} | {out['grad_sq']:.2e} +- {out.get('grad_sq_se', float('nan')):.1e} | {out['trace_cov']:.2e} | "
          f"{out['noise_scale']:.0f} | {lower:.0f} | {lower / images * batch_s / 60:.1f} | {out['pairwise_cosine']:.4f} |")


if __name__ == "__main__":
    main()
