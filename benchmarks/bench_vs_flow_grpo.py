"""pixelrl against flow_grpo's own training script, side by side on one machine.

flow_grpo (github.com/yifan123/flow_grpo) is not a dependency of pixelrl: clone it anywhere and
pass the checkout. Its script needs `ml-collections` besides what pixelrl installs (absl-py and
accelerate come with pixelrl's dependencies); wandb is replaced by a no-op module, the same as
running it with WANDB_MODE=disabled:

    .venv/bin/pip install ml-collections
    .venv/bin/python benchmarks/bench_vs_flow_grpo.py --flow-grpo /path/to/flow_grpo --pairs 4 --inline-too
    .venv/bin/python benchmarks/bench_vs_flow_grpo.py --flow-grpo /path/to/flow_grpo --model compute --iters 1

Both sides load the same tiny SD3 pipeline folder (CLIP x2 + T5, a VAE, 64 px) and run
flow_grpo's small setting: 10 sampling steps, CFG 4.5 at sampling and in training, noise level
0.7, 2 prompts x 8 images per iteration sampled in batches of 8, the first 9 steps trained,
train batch 8 (two optimizer steps per iteration), KL to the adapter-disabled reference with
beta 0.04, clip 1e-4, LoRA r32 / alpha 64 on the attention projections (the rank flow_grpo's
script hard-codes), AdamW 3e-4, fp32, 2 threads, JPEG compressibility as the reward. The
flow_grpo side runs its `scripts/train_sd3.py` unmodified from the checkout; this file only
writes its config, counts and times calls (`phase_meter.py`, the same hooks and wrappers on both
sides) and stops it after the timed iterations. Each run is its own process, the runs alternate
(A B A B ...), and the tables show medians. `--inline-too` adds a flow_grpo run that scores rewards
on its training thread instead of its thread pool (see `--reward-inline`).

`--model compute` swaps in an ~18M-parameter transformer (8 joint blocks, width 256), where the
arithmetic, not the per-call overhead, is the cost. The pixelrl side can also run its faster
execution options on the same math (`--pixelrl LABEL=OPTIONS`, e.g. `--rollout-micro 16
--steps-per-forward 0 --compile`), or run as `pixelrl train` does on Ray workers: `--workers 2
--threads 1` is two single-thread DDP workers on the two cores, each sampling and training one
prompt's 8 images (the trainer's own phase timings; the update is one phase there).
`--reference-processes 2` gives flow_grpo the same layout: its script launched by torchrun on two
processes of one thread each (accelerate's MULTI_CPU, DDP over gloo), each sampling and training
half of every batch; the first process's timings are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import peak_rss_mb  # noqa: E402
MODELS = {  # build_tiny_sd3 arguments
    "tiny": {},
    "compute": {"num_layers": 8, "heads": 4, "head_dim": 64},
}
SETTING = {"prompts": 2, "n": 8, "steps": 10, "cfg": 4.5, "resolution": 64, "micro": 8, "kl": 0.04, "lora_rank": 32,
           "max_seq_len": 128, "threads": 2}
PROMPTS = [f"a {c} {s} number {i}" for i in range(8) for c in ("red", "blue") for s in ("circle", "square")]


def build_model(workdir: Path, model: str) -> Path:
    from pixelrl.models import build_tiny_sd3

    path = workdir / f"sd3_{model}"
    if not (path / "model_index.json").exists():
        build_tiny_sd3(path, resolution=SETTING["resolution"], with_vae=True, with_t5=True,
                       text_max_length=77, **MODELS[model])  # flow_grpo pads CLIP prompts to 77 tokens
    data = workdir / "prompts"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (data / "test.txt").write_text(PROMPTS[0] + "\n")
    return path


# ------------------------------------------------------------------ the flow_grpo side (one process)
REFERENCE_CONFIG = """\
import importlib.util
spec = importlib.util.spec_from_file_location("flow_grpo_base", {base!r})
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)


def get_config():
    config = base.get_config()
    config.pretrained.model = {model!r}
    config.dataset = {data!r}
    config.logdir = config.save_dir = {logdir!r}
    config.mixed_precision = "no"
    config.resolution = {resolution}
    config.sample.num_steps = config.sample.eval_num_steps = {steps}
    config.sample.guidance_scale = {cfg}
    config.sample.noise_level = 0.7
    config.sample.train_batch_size = {micro}
    config.sample.num_image_per_prompt = {n}
    config.sample.num_batches_per_epoch = {batches}
    config.sample.test_batch_size = 1
    config.sample.global_std = True
    config.train.batch_size = {micro}
    config.train.gradient_accumulation_steps = {batches} // 2
    config.train.timestep_fraction = 0.99
    config.train.beta = {kl}
    config.prompt_fn = "general_ocr"
    config.reward_fn = {{"jpeg_compressibility": 1.0}}
    config.per_prompt_stat_tracking = True
    config.eval_freq = config.save_freq = 10 ** 9
    return config
"""


class _Done(Exception):
    pass


def run_reference(args) -> dict:
    """flow_grpo's train_sd3.main under the phase meter; iteration boundaries are the sampler's
    set_epoch calls that open an epoch's first sampling batch."""
    import importlib.machinery
    import types

    import torch

    torch.set_num_threads(SETTING["threads"] // args.processes)
    if args.processes > 1:  # without it, accelerate on a machine without GPUs ignores torchrun's world size
        os.environ["ACCELERATE_USE_CPU"] = "true"
    checkout = Path(args.flow_grpo).resolve()
    sys.path[:0] = [str(checkout), str(checkout / "scripts")]
    from phase_meter import PhaseMeter

    meter = PhaseMeter()
    meter.install()
    import accelerate

    wandb = types.ModuleType("wandb")  # what WANDB_MODE=disabled makes of it: calls that do nothing
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = wandb.log = wandb.Image = lambda *a, **k: None
    sys.modules["wandb"] = wandb
    import train_sd3

    batches = SETTING["prompts"] * SETTING["n"] // SETTING["micro"]
    boundaries: list[float] = []
    snapshots: list[tuple[dict, dict]] = []
    wanted = args.warmup + args.iters + 1

    set_epoch = train_sd3.DistributedKRepeatSampler.set_epoch

    def timed_set_epoch(self, value):
        if value % batches == 0:
            boundaries.append(time.perf_counter())
            snapshots.append(meter.snapshot())
            if len(boundaries) == wanted:
                raise _Done
        set_epoch(self, value)

    train_sd3.DistributedKRepeatSampler.set_epoch = timed_set_epoch
    pipeline_class = train_sd3.StableDiffusion3Pipeline

    class WatchedPipeline:  # the script's only use of the class: from_pretrained
        @staticmethod
        def from_pretrained(*a, **k):
            pipeline = pipeline_class.from_pretrained(*a, **k)
            meter.watch(pipeline.transformer)
            return pipeline

    train_sd3.StableDiffusion3Pipeline = WatchedPipeline
    for name in ("pipeline_with_logprob", "compute_text_embeddings"):
        original = getattr(train_sd3, name)

        def sampling(*a, __original=original, **k):
            with meter.phase("sampling"):
                return __original(*a, **k)

        setattr(train_sd3, name, sampling)
    multi_score = train_sd3.flow_grpo.rewards.multi_score

    def timed_multi_score(*a, **k):
        score = multi_score(*a, **k)

        def timed(*sa, **sk):
            with meter.phase("reward"):
                return score(*sa, **sk)

        return timed

    train_sd3.flow_grpo.rewards.multi_score = timed_multi_score
    # The script reaches the reference through `transformer.module` (its model is always wrapped
    # by DDP on GPUs); accelerate does not wrap a single CPU process, so the model is its own module.
    prepare = accelerate.Accelerator.prepare

    def prepare_with_module(self, *objects):
        prepared = prepare(self, *objects)
        if not hasattr(prepared[0], "module"):
            object.__setattr__(prepared[0], "module", prepared[0])
        return prepared

    accelerate.Accelerator.prepare = prepare_with_module
    if args.reward_inline:
        # The script scores rewards on a thread pool. Torch ops on a second thread give that thread
        # its own OpenMP team; with more OpenMP threads than cores libgomp stops spinning and parks
        # its workers after every parallel region (tens of thousands of context switches per
        # iteration here). Scoring on the calling thread removes that without changing the math.
        from concurrent import futures

        class InlineExecutor:
            def __init__(self, *a, **k):
                pass

            def submit(self, fn, *a, **k):
                future = futures.Future()
                future.set_result(fn(*a, **k))
                return future

        train_sd3.futures = types.SimpleNamespace(ThreadPoolExecutor=InlineExecutor)

    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "bench_config.py"
        config_file.write_text(REFERENCE_CONFIG.format(
            base=str(checkout / "config" / "base.py"), model=str(args.model_dir), data=str(args.data_dir),
            logdir=tmp, batches=batches, **{**SETTING, "micro": SETTING["micro"] // args.processes}))
        os.chdir(tmp)  # the script writes its logs under the working directory
        train_sd3.FLAGS([sys.argv[0], f"--config={config_file}"])
        try:
            train_sd3.main([])
        except _Done:
            pass
    images = SETTING["prompts"] * SETTING["n"]
    total = boundaries[-1] - boundaries[args.warmup]
    return {
        "side": "flow_grpo", "iter_img_s": images * args.iters / total, "s_per_iter": total / args.iters,
        "split": meter.per_iteration(snapshots[args.warmup], snapshots[-1], args.iters),
        "peak_rss_mb": peak_rss_mb(),
    }


# ------------------------------------------------------------------------------ the pixelrl side
def pixelrl_command(args, model_dir: Path, extra: str) -> list[str]:
    s = SETTING
    return [sys.executable, str(HERE / "bench_flow_grpo.py"), "--json", "--split-phases", "--model-dir", str(model_dir),
            "--prompts", str(s["prompts"]), "--n", str(s["n"]), "--steps", str(s["steps"]), "--cfg", str(s["cfg"]),
            "--resolution", str(s["resolution"]), "--micro", str(s["micro"]), "--mini", str(s["micro"]),
            "--rollout-micro", str(s["micro"]), "--kl", str(s["kl"]), "--lora-rank", str(s["lora_rank"]),
            "--max-seq-len", str(s["max_seq_len"]), "--threads", str(s["threads"]), "--iters", str(args.iters),
            "--warmup", str(args.warmup), *extra.split()]


PHASES = ("sampling", "reward", "reference_forward", "policy_forward", "backward", "optimizer")


def row(label: str, runs: list[dict]) -> str:
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    cells = [label, f"{med(lambda r: r['iter_img_s']):.2f}", f"{med(lambda r: r['s_per_iter']):.2f}"]
    # a run on Ray workers (--workers) times the whole update as one phase (the trainer's timing_s/update_actor)
    whole_update = "update" in runs[0]["split"]["seconds"]
    for name in PHASES:
        if whole_update and name in ("backward", "optimizer"):
            cells.append("-")
            continue
        key = "update" if whole_update and name == "policy_forward" else name
        seconds = med(lambda r: r["split"]["seconds"].get(key, 0.0))
        cells.append(f"{seconds:.2f} (whole update)" if key == "update" else f"{seconds:.2f}")
    # the reward runs inside the iteration on pixelrl's side and beside sampling on flow_grpo's
    other = med(lambda r: r["s_per_iter"] - sum(v for n, v in r["split"]["seconds"].items() if n != "reward"))
    cells.append(f"{other:.2f}")
    calls = [med(lambda r: r["split"]["calls"].get(name, 0)) for name in
             ("sampling_forward", "reference_forward", "policy_forward", "backward")]
    cells.append(" / ".join(f"{c:.0f}" for c in calls) if runs[0]["split"]["calls"] else "-")
    cells.append(f"{med(lambda r: r['peak_rss_mb']):.0f}")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow-grpo", required=True, help="a checkout of github.com/yifan123/flow_grpo")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--pairs", type=int, default=4, help="rounds of alternation (each runs every variant once)")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--pixelrl", action="append", metavar="LABEL=OPTIONS",
                        help="a pixelrl variant: bench_flow_grpo.py options on top of the shared setting, e.g. "
                             "'whole-batch rollout=--rollout-micro 16' (repeatable; default: one with none)")
    parser.add_argument("--inline-too", action="store_true",
                        help="also run flow_grpo with its rewards scored on the training thread (--reward-inline)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pixelrl_vs_flow_grpo"))
    parser.add_argument("--side", choices=["flow_grpo"], help=argparse.SUPPRESS)  # one run, in a subprocess
    parser.add_argument("--reward-inline", action="store_true",
                        help="flow_grpo side: score rewards on the training thread instead of its thread pool")
    parser.add_argument("--reference-processes", type=int, default=0,
                        help="also run flow_grpo on this many processes (torchrun, accelerate over gloo) sharing "
                             "the threads, each sampling and training its share of every batch")
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)  # set by torchrun's launch
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = run_reference(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        os._exit(0)  # flow_grpo's reward executor and data-loader workers would keep the process alive
    train_script = Path(args.flow_grpo) / "scripts" / "train_sd3.py"
    if not train_script.is_file():
        raise SystemExit(f"--flow-grpo {args.flow_grpo}: no scripts/train_sd3.py there; pass a flow_grpo checkout")
    variants = {}
    for spec in args.pixelrl or ["pixelrl=" ]:
        label, sep, extra = spec.partition("=")
        if not sep:
            raise SystemExit(f"--pixelrl {spec!r}: write LABEL=OPTIONS (OPTIONS may be empty)")
        variants[f"pixelrl, {label}" if label != "pixelrl" else label] = extra
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(workdir, args.model)
    reference = [sys.executable, __file__, "--side", "flow_grpo", "--flow-grpo", args.flow_grpo, "--model-dir",
                 str(model_dir), "--data-dir", str(workdir / "prompts"), "--iters", str(args.iters), "--warmup",
                 str(args.warmup)]
    commands = {label: pixelrl_command(args, model_dir, extra) for label, extra in variants.items()}
    commands["flow_grpo"] = reference
    if args.inline_too:
        commands["flow_grpo, rewards inline"] = reference + ["--reward-inline"]
    if args.reference_processes > 1:
        p = args.reference_processes
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}"]
        commands[f"flow_grpo, {p} processes"] = launch + reference[1:] + ["--processes", str(p)]
        if args.inline_too:
            commands[f"flow_grpo, {p} processes, rewards inline"] = launch + reference[1:] + [
                "--processes", str(p), "--reward-inline"]
    runs: dict[str, list[dict]] = {label: [] for label in commands}
    for _ in range(args.pairs):
        for label, cmd in commands.items():
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{label} run failed:\n{out.stderr[-3000:]}")
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# model {args.model} ({MODELS[args.model] or 'build_tiny_sd3 defaults'}), setting {SETTING}; "
          f"pixelrl variants {variants}; {args.pairs} rounds of alternating runs, {args.iters} timed iterations "
          f"after {args.warmup} warm-up each; medians; seconds per iteration")
    header = ("| system | iteration img/s | s/iter | sampling | reward | reference fwd | policy fwd | backward "
              "| optimizer | other | calls: sampling / ref / policy / backward | peak RSS MB |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for label, rs in runs.items():
        print(row(label, rs))
    first = next(iter(variants))
    gflop = statistics.median(r["gflop_per_iter"] for r in runs[first])
    peak = statistics.median(r["peak_gflop_s"] for r in runs[first])
    print(f"{gflop:.1f} GFLOP per iteration (torch's FLOP counter in pixelrl's run; the same work on both sides); "
          f"fp32 matmul peak measured in pixelrl's process: {peak:.0f} GFLOP/s")
    for label, rs in runs.items():
        achieved = gflop / statistics.median(r["s_per_iter"] for r in rs)
        print(f"  {label}: {achieved:.1f} GFLOP/s = {achieved / peak:.1%} of the peak")
    for label in variants:
        for ref in [k for k in runs if k.startswith("flow_grpo")]:
            ratio = statistics.median(a["iter_img_s"] / b["iter_img_s"] for a, b in zip(runs[label], runs[ref]))
            print(f"{label} / {ref}: {ratio:.2f}x iteration images/s (median over the rounds)")


if __name__ == "__main__":
    main()
