"""Flow-GRPO throughput on a tiny model (SD3 by default, FLUX, Qwen-Image or Wan), in one process
(no Ray) or through `pixelrl train` on Ray workers (`--workers`).

Prints, per configuration: images/s for rollout and for a full iteration, seconds per phase,
denoiser forwards (with and without grad) per iteration, and peak RSS. Each configuration runs
in its own subprocess so that peak RSS belongs to it alone. The default sweep scales batch,
sampling steps, window and workers (1 and 2) in one table.

    python benchmarks/bench_flow_grpo.py                 # the default sweep
    python benchmarks/bench_flow_grpo.py --prompts 4 --n 4 --steps 10 --iters 3   # one config
    python benchmarks/bench_flow_grpo.py --per-family    # one row per model family (4 x 4, 10 steps)
    python benchmarks/bench_flow_grpo.py --ab steps_per_forward --pairs 4   # 1 vs all window steps per forward
    python benchmarks/bench_flow_grpo.py --ab compile --pairs 4             # eager vs torch.compile'd denoiser
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import mib, peak_rss_mb, train_and_measure  # noqa: E402

SWEEP = [  # (prompts per step, images per prompt, sampling steps, window size (0 = full), Ray workers
    #  (0 = one process without Ray), torch threads per process)
    (2, 4, 10, 0, 0, 2),
    (4, 4, 10, 0, 0, 2),
    (8, 4, 10, 0, 0, 2),
    (4, 4, 6, 0, 0, 2),
    (4, 4, 20, 0, 0, 2),
    (4, 4, 10, 2, 0, 2),
    (4, 4, 10, 0, 1, 2),  # the same step through `pixelrl train` on one 2-core worker
    (4, 4, 10, 0, 1, 1),  # ... on one 1-core worker
    (8, 4, 10, 0, 2, 1),  # two 1-core workers, the same batch per worker: per-worker efficiency
    (4, 4, 10, 0, 2, 1),  # two 1-core workers sharing the first row's batch: the layout on 2 cores
]


def run_one(args) -> dict:
    import torch

    from pixelrl.config.sections import PixelRLConfig
    from pixelrl.models import build_tiny_sd3
    from pixelrl.models.flux import build_tiny_flux
    from pixelrl.models.qwen_image import build_tiny_qwen_image
    from pixelrl.models.wan import build_tiny_wan
    from pixelrl.rewards import RewardSpec, WeightedReward
    from pixelrl.engine import PolicyEngine
    from pixelrl.testing import transition_step

    torch.set_num_threads(args.threads)
    meter = None
    if args.split_phases:  # the same wrappers as the reference side of bench_vs_flow_grpo.py
        from phase_meter import PhaseMeter

        meter = PhaseMeter()
        meter.install()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PixelRLConfig(seed=0)
        if args.model_dir:  # an existing SD3 folder (with T5: max_sequence_length tokens of it)
            path = args.model_dir
            cfg.model.max_sequence_length = args.max_seq_len
        elif args.family == "flux":  # FLUX always has a VAE and T5; guidance is an input (no CFG batch)
            path = build_tiny_flux(os.path.join(tmp, "tiny"), resolution=args.resolution)
            cfg.model.type, cfg.model.max_sequence_length = "flux", 16
        elif args.family == "qwen_image":
            path = build_tiny_qwen_image(os.path.join(tmp, "tiny"), resolution=args.resolution)
            cfg.model.type, cfg.model.max_sequence_length = "qwen_image", 64
        elif args.family == "wan":  # 5-frame videos at the resolution (3 latent frames)
            path = build_tiny_wan(os.path.join(tmp, "tiny"))
            cfg.model.type, cfg.model.max_sequence_length, cfg.model.num_frames = "wan", 16, 5
        else:
            path = build_tiny_sd3(os.path.join(tmp, "tiny"), resolution=args.resolution, with_vae=not args.no_vae,
                                  with_t5=False)
            cfg.model.max_sequence_length = 0
        cfg.model.path = str(path)
        cfg.model.lora_rank, cfg.model.lora_alpha = args.lora_rank, 2 * args.lora_rank
        cfg.rollout.resolution, cfg.rollout.n, cfg.rollout.num_steps = args.resolution, args.n, args.steps
        cfg.rollout.guidance_scale = args.cfg
        cfg.rollout.sde_window_size = args.window
        cfg.rollout.micro_batch_size = args.rollout_micro or args.prompts * args.n
        cfg.actor.ppo_micro_batch_size = args.micro
        cfg.actor.ppo_mini_batch_size = args.mini
        cfg.data.train_batch_size = args.prompts  # the prompts of one step: fixes the mini-batch count
        cfg.actor.window_steps_per_forward = args.steps_per_forward
        cfg.model.compile = args.compile
        cfg.diffusion_loss.kl_coef = args.kl
        engine = PolicyEngine.from_config(cfg)
        if meter is not None:
            meter.watch(engine.model.transformer)
            rollout = engine.rollout

            def timed_rollout(*a, **k):
                with meter.phase("sampling"):
                    return rollout(*a, **k)

            engine.rollout = timed_rollout
        reward = WeightedReward([RewardSpec("jpeg_compressibility")])
        prompts = [f"a red circle number {i}" for i in range(args.prompts)]
        for warm in range(args.warmup):  # warm-up (and compilation with --compile)
            transition_step(engine, reward, prompts, [{}] * args.prompts, warm + 1, cfg)
        phases: dict[str, float] = {}
        total_time = 0.0
        before = meter.snapshot() if meter is not None else None
        counts = {"perf/denoiser_forwards": 0.0, "perf/denoiser_backwards": 0.0, "perf/tflop": 0.0, "perf/mfu": 0.0}
        for it in range(args.iters):
            start = time.perf_counter()
            _, metrics = transition_step(engine, reward, prompts, [{}] * args.prompts, args.warmup + it + 1, cfg)
            total_time += time.perf_counter() - start
            for key in counts:  # the engine's FLOP meter: measured forward FLOPs, 3x for graph forwards
                counts[key] += metrics[key] / args.iters
            for key, value in metrics.items():
                if key.startswith("timing_s/") and key != "timing_s/step":
                    phases[key[9:]] = phases.get(key[9:], 0.0) + value / args.iters
        images = args.prompts * args.n
        split = meter.per_iteration(before, meter.snapshot(), args.iters) if meter is not None else {}
        return {
            "family": args.family, "prompts": args.prompts, "n": args.n, "steps": args.steps, "window": args.window or args.steps - 1,
            "images_per_iter": images,
            "rollout_img_s": images / phases["gen"],
            "iter_img_s": images * args.iters / total_time,
            "s_per_iter": total_time / args.iters,
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "fwd_nograd_per_iter": counts["perf/denoiser_forwards"] - counts["perf/denoiser_backwards"],
            "fwd_grad_per_iter": counts["perf/denoiser_backwards"],
            "gflop_per_iter": counts["perf/tflop"] * 1000,
            "achieved_gflop_s": counts["perf/tflop"] * 1000 * args.iters / total_time,
            "mfu": counts["perf/mfu"],
            "peak_gflop_s": metrics["perf/peak_tflops"] * 1000,
            "peak_rss_mb": peak_rss_mb(),
            "split": split,
        }


def run_workers(args) -> dict:
    """The same step through `pixelrl train` on `--workers` Ray actor workers of `--threads` cores
    each (DDP; each worker samples and trains its share of the prompts). Per-phase seconds are
    the trainer's own `timing_s/*` (sampling with decoding, reference, the whole update);
    FLOPs and FLOP/s are summed over the workers, forward counts, MFU and peak memory are per
    worker (averaged over the workers)."""
    import ray

    from pixelrl.models import build_tiny_sd3
    from pixelrl.workers.local_ray import start_local_ray

    if args.family != "sd3":
        raise SystemExit("--workers runs the SD3 family only")
    start_local_ray(os.cpu_count() or 1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.model_dir:
                model, seq_len = args.model_dir, args.max_seq_len
            else:
                model = build_tiny_sd3(os.path.join(tmp, "tiny"), resolution=args.resolution, with_vae=not args.no_vae,
                                       with_t5=False)
                seq_len = 0
            prompts = os.path.join(tmp, "prompts.txt")
            with open(prompts, "w") as f:
                f.write("".join(f"a red circle number {i}\n" for i in range(args.prompts)))
            per_worker_rollout = args.rollout_micro or args.prompts * args.n // args.workers
            r = train_and_measure(None, model, Path(tmp) / "runs", "bench", [
                f"trainer.n_workers={args.workers}", f"trainer.num_cpus_per_worker={args.threads}",
                f"trainer.total_training_steps={args.warmup + args.iters}", "trainer.test_freq=-1",
                f"data.train_files=[{prompts}]", f"data.train_batch_size={args.prompts}",
                f"model.max_sequence_length={seq_len}", f"model.lora_rank={args.lora_rank}",
                f"model.lora_alpha={2 * args.lora_rank}", f"model.compile={args.compile}",
                f"rollout.resolution={args.resolution}", f"rollout.n={args.n}", f"rollout.num_steps={args.steps}",
                f"rollout.guidance_scale={args.cfg}", f"rollout.sde_window_size={args.window}",
                f"rollout.micro_batch_size={per_worker_rollout}", f"actor.ppo_micro_batch_size={args.micro}",
                f"actor.ppo_mini_batch_size={args.mini}", f"actor.window_steps_per_forward={args.steps_per_forward}",
                f"diffusion_loss.kl_coef={args.kl}"], warmup=args.warmup)
    finally:
        ray.shutdown()
    last, phases = r["last"], r["phases"]
    return {
        "family": args.family, "prompts": args.prompts, "n": args.n, "steps": args.steps, "window": args.window or args.steps - 1,
        "workers": args.workers, "images_per_iter": r["images"], "rollout_img_s": r["images"] / phases["gen"],
        "iter_img_s": r["img_s"], "s_per_iter": r["step_s"], "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "fwd_nograd_per_iter": last["perf/denoiser_forwards"] - last["perf/denoiser_backwards"],
        "fwd_grad_per_iter": last["perf/denoiser_backwards"],
        "gflop_per_iter": last["perf/tflop"] * 1000 * args.workers,
        "achieved_gflop_s": last["perf/tflop"] * 1000 * args.workers / r["step_s"], "mfu": last["perf/mfu"],
        "peak_gflop_s": last["perf/peak_tflops"] * 1000 * args.workers,
        "peak_rss_mb": mib(last["perf/peak_memory_gb"]),
        "split": {"seconds": {"sampling": phases["gen"], "reward": phases.get("reward", 0.0),
                              "reference_forward": phases.get("ref", 0.0), "update": phases["update_actor"]},
                  "calls": {}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8, help="actor.ppo_micro_batch_size")
    parser.add_argument("--mini", type=int, default=0, help="actor.ppo_mini_batch_size (0 = one optimizer step per iteration)")
    parser.add_argument("--rollout-micro", type=int, default=0, help="rollout.micro_batch_size (0 = the whole batch)")
    parser.add_argument("--lora-rank", type=int, default=8, help="model.lora_rank (alpha = 2 x rank)")
    parser.add_argument("--model-dir", help="use this SD3 folder instead of building a tiny one")
    parser.add_argument("--max-seq-len", type=int, default=0, help="model.max_sequence_length with --model-dir")
    parser.add_argument("--split-phases", action="store_true", help="time sampling, forwards, backward and optimizer per phase (phase_meter.py)")
    parser.add_argument("--cfg", type=float, default=1.0, help="guidance scale (>1 doubles the batch per forward)")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--no-vae", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", choices=["sd3", "flux", "qwen_image", "wan"], default="sd3", help="the tiny model's family")
    parser.add_argument("--per-family", action="store_true", help="one row per family at 4 prompts x 4, 10 steps")
    parser.add_argument("--steps-per-forward", type=int, default=1, help="actor.window_steps_per_forward (0 = all)")
    parser.add_argument("--kl", type=float, default=0.0, help="diffusion_loss.kl_coef (> 0 scores the reference)")
    parser.add_argument("--compile", action="store_true", help="model.compile: torch.compile the denoiser's forward")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--ab", choices=sorted(AB), help="alternate the option off and on for one config; medians of --pairs")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON line (used by the sweep)")
    parser.add_argument("--workers", type=int, default=0,
                        help="run through `pixelrl train` on this many Ray actor workers of --threads cores each "
                             "(DDP); 0 = one process, no Ray")
    args = parser.parse_args()
    from pixelrl.core.quiet import quiet_libraries

    quiet_libraries()
    common = ["--iters", str(args.iters), "--micro", str(args.micro), "--cfg", str(args.cfg),
              "--resolution", str(args.resolution), "--warmup", str(args.warmup)]
    common += ["--no-vae"] if args.no_vae else []
    if args.ab:
        return ab_pairs(args, common + ["--threads", str(args.threads)])
    if args.prompts is not None:
        result = run_workers(args) if args.workers else run_one(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return
    if args.per_family:
        return per_family(common + ["--threads", str(args.threads)])
    print(f"# tiny SD3 ({'pixel space' if args.no_vae else 'VAE'}), {args.resolution}px, LoRA r8, CFG {args.cfg}, "
          f"micro-batch {args.micro}, {args.iters} timed iterations after {args.warmup} warm-up; workers x threads: "
          "'1 process' runs without Ray, N x T runs `pixelrl train` on N Ray workers of T threads (images/s, "
          "GFLOP and GFLOP/s over all workers; forwards, MFU and RSS per worker); MFU = model FLOP/s (forward FLOPs measured by "
          "torch's counter, 3x for forward+backward) over a matmul peak measured in the same process")
    header = ("| prompts x n | steps | window | workers x threads | rollout img/s | iteration img/s | s/iter | gen s "
              "| reward s | update s | fwd no-grad/iter | fwd+bwd/iter | GFLOP/iter | GFLOP/s | MFU | peak RSS MB |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for prompts, n, steps, window, workers, threads in SWEEP:
        cmd = [sys.executable, __file__, "--json", "--prompts", str(prompts), "--n", str(n), "--steps", str(steps),
               "--window", str(window), "--workers", str(workers), "--threads", str(threads)] + common
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        p = r["phases_s"]
        layout = f"{workers} x {threads}" if workers else f"1 process, {threads} threads"
        print(f"| {prompts} x {n} | {steps} | {r['window']} | {layout} | {r['rollout_img_s']:.1f} | {r['iter_img_s']:.1f} "
              f"| {r['s_per_iter']:.2f} | {p['gen']:.2f} | {p['reward']:.3f} | {p['update_actor']:.2f} "
              f"| {r['fwd_nograd_per_iter']:.0f} | {r['fwd_grad_per_iter']:.0f} | {r['gflop_per_iter']:.2f} "
              f"| {r['achieved_gflop_s']:.1f} | {r['mfu']:.1%} | {r['peak_rss_mb']:.0f} |", flush=True)


# --ab NAME: (row label, extra arguments) for the option off, then on
AB = {
    "steps_per_forward": (("window steps per forward", "1", ["--steps-per-forward", "1"]),
                          ("window steps per forward", "all", ["--steps-per-forward", "0"])),
    "compile": (("denoiser", "eager", []), ("denoiser", "torch.compile", ["--compile"])),
}


def ab_pairs(args, common: list[str]) -> None:
    """The same configuration with an option off and on (`AB`), alternating (A B A B ...),
    medians over the pairs."""
    import statistics

    prompts = args.prompts or 2
    base = [sys.executable, __file__, "--json", "--prompts", str(prompts), "--n", str(args.n), "--steps", str(args.steps),
            "--window", str(args.window), "--kl", str(args.kl), *common]
    print(f"# {prompts} prompts x {args.n}, {args.steps} steps, window {args.window or args.steps - 1}, KL {args.kl}, "
          + " ".join(common) + f"; {args.pairs} alternating pairs, medians")
    (column, off, off_args), (_, on, on_args) = AB[args.ab]
    if args.ab != "steps_per_forward":
        base += ["--steps-per-forward", str(args.steps_per_forward)]
    rows = {off: [], on: []}
    for _ in range(args.pairs):
        for label, extra in ((off, off_args), (on, on_args)):
            out = subprocess.run(base + extra, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows[label].append(json.loads(out))
    header = (f"| {column} | iteration img/s | s/iter | gen s | update s | reference s | fwd+bwd calls/iter "
              "| GFLOP/s | MFU | peak RSS MB |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for label, runs in rows.items():
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        print(f"| {label} | {med(lambda r: r['iter_img_s']):.2f} | {med(lambda r: r['s_per_iter']):.2f} "
              f"| {med(lambda r: r['phases_s']['gen']):.2f} | {med(lambda r: r['phases_s']['update_actor']):.2f} | {med(lambda r: r['phases_s'].get('ref', 0.0)):.2f} "
              f"| {med(lambda r: r['fwd_grad_per_iter']):.0f} | {med(lambda r: r['achieved_gflop_s']):.1f} "
              f"| {med(lambda r: r['mfu']):.1%} | {med(lambda r: r['peak_rss_mb']):.0f} |", flush=True)
    speedup = statistics.median(b["iter_img_s"] / a["iter_img_s"] for a, b in zip(rows[off], rows[on]))
    print(f"median speed-up of {on} over {off}: {speedup:.2f}x")


def per_family(common: list[str]) -> None:
    """One row per model family: the same RL step on each family's tiny model."""
    print("# 4 prompts x 4 images, 10 steps, full window; " + " ".join(common))
    header = "| family | rollout samples/s | iteration samples/s | s/iter | gen s | update s | GFLOP/iter | MFU | peak RSS MB |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for family in ("sd3", "flux", "qwen_image", "wan"):
        cmd = [sys.executable, __file__, "--json", "--prompts", "4", "--n", "4", "--steps", "10", "--family", family,
               *common]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        p = r["phases_s"]
        print(f"| {family} | {r['rollout_img_s']:.1f} | {r['iter_img_s']:.1f} | {r['s_per_iter']:.2f} | {p['gen']:.2f} "
              f"| {p['update_actor']:.2f} | {r['gflop_per_iter']:.2f} | {r['mfu']:.1%} | {r['peak_rss_mb']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
