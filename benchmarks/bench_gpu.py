"""The paper configs on whatever CUDA GPU is here, on random-weight models of the real shapes.

    python benchmarks/bench_gpu.py --out runs/bench_gpu                  # every case, 4 steps each
    python benchmarks/bench_gpu.py --cases sd35,sd35_tuned --steps 5
    python benchmarks/bench_gpu.py --scale tiny --device cpu --cases all  # the same code on a CPU, in seconds
    git archive REV src | tar -x -C /tmp/base && python benchmarks/bench_gpu.py --baseline-src /tmp/base/src
        # each case first from another version's source, then from this one: an A/B on one card

Each case is one `pixelrl train` process (`trainer.backend=local`, one worker), so its peak
memory is its own. Per case it prints the steady state (the steps after the first): s/step,
images/s on this GPU, MFU against `--peak-tflops` (the card's dense bf16 peak; 989 for an
H100/H200 SXM), peak memory, the phase split and the denoiser forwards / backwards per step,
then the GPU, torch and CUDA versions. Results go to `<out>/results.jsonl` as each case ends, so
a case that times out loses only itself. Folders are built once per family under `<out>/models`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import BUILDERS  # noqa: E402

PROMPTS = ["a photo of a red car next to a tree", "a watercolor painting of a city street",
           "a cat sitting on a blue chair", "two dogs playing in the sea", "a house on a mountain at night",
           "a sign that says sun", "a yellow flower in a small glass", "three stars above a green field"]
# Every case trains 2 prompts x 8 images = 16 images per step with 2 optimizer steps per rollout
# batch (mini-batch 8): the paper configs' schedule at one GPU's share of their batch.
COMMON = ["trainer.backend=local", "trainer.n_workers=1", "data.train_batch_size=2", "rollout.n=8",
          "actor.ppo_mini_batch_size=8", "trainer.save_freq=-1", "trainer.test_freq=-1", "data.val_files=[]",
          "trainer.logger=[jsonl]", "trainer.project_name=bench", "reward.placement=colocated",
          'reward.functions=[{name: jpeg_compressibility, weight: 1.0}]']
# the SD3.5 recipe's sizes before they were `auto`: the reference's micro-batch 4 with checkpointing
WRITTEN = ["actor.ppo_micro_batch_size=4", "model.gradient_checkpointing=true", "rollout.micro_batch_size=8",
           "model.compile=false"]
# the micro-batch the engine runs whole (each optimizer step's 8 samples), no checkpointing; eager,
# as measured before the recipes compiled on a GPU (model.compile=auto)
TUNED = ["actor.ppo_micro_batch_size=16", "model.gradient_checkpointing=false"]
CASES = {  # name: (family, config, overrides); the configs' sizes are `auto`: fitted to this GPU, and
    # their blocks compiled (model.compile=auto; step 1 compiles)
    "sd35": ("sd35", "flow_grpo_sd35", []),
    "sd35_reference_sizes": ("sd35", "flow_grpo_sd35", WRITTEN),
    "sd35_tuned": ("sd35", "flow_grpo_sd35", [*TUNED, "model.compile=false"]),
    "sd35_compiled": ("sd35", "flow_grpo_sd35", [*TUNED, "model.compile=true"]),
    "sd35_fast": ("sd35", "flow_grpo_fast_sd35", []),
    "sd35_fast_tuned": ("sd35", "flow_grpo_fast_sd35", [*TUNED, "model.compile=false"]),
    "awm_sd35": ("sd35", "awm_sd35", [*TUNED, "model.compile=false"]),
    # one video of 33 frames per prompt-group member is the expensive unit: 1 prompt x 4 videos
    "wan": ("wan", "dance_grpo_wan", ["data.train_batch_size=1", "rollout.n=4", "actor.ppo_mini_batch_size=2"]),
    "flux": ("flux", "flow_grpo_flux", []),
    # an edit family: FLUX.1-Kontext-dev's shape on edit rows (instruction, 384 px source; edit_rows)
    "flux_kontext": ("flux_kontext", "flow_grpo_flux_kontext", []),
    # DMD2 as Flow-Factory's SD3.5-M recipe trains it (five fake-score attempts, one student attempt,
    # one rollout replayed by all six), at 64 samples per step (8 prompts x 8): one GPU's share of the 512
    "dmd2_sd35": ("sd35", "dmd2_sd35", ["data.train_batch_size=8", "rollout.n=8", "trainer.test_freq=-1"]),
    # 8 prompts x 8 images in one optimizer step, the `auto` sizes chosen for this GPU: checks the
    # estimate above the 16-32 rows per call the planner was calibrated on
    "sd35_fast_fit": ("sd35", "flow_grpo_fast_sd35", ["data.train_batch_size=8", "actor.ppo_mini_batch_size=64"]),
}
TINY_OVERRIDES = ["rollout.resolution=32", "model.device=cpu", "model.dtype=float32", "model.max_sequence_length=16",
                  "rollout.micro_batch_size=4", "model.gradient_checkpointing=false", "rollout.num_steps=4",
                  "rollout.sde_window_size=0", "rollout.sde_window_range=null", "model.num_frames=1"]


def versions() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    for name in ("diffusers", "transformers", "peft"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def steady_state(rows: list[dict]) -> dict:
    """Medians over the steps after the first (compilation, caches and allocator warm-up)."""
    rows = rows[1:] or rows
    keys = sorted({k for r in rows for k in r if k.startswith(("timing_s/", "perf/"))})
    out = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    out["steps_measured"] = len(rows)
    return out


EDIT_TYPES = ("flux_kontext", "qwen_image_edit")  # families whose rows carry a source image


def edit_rows(out: Path) -> Path:
    """A jsonl of the PROMPTS as edit instructions, each with a 384 px source of its own (a colour
    gradient: the content does not change the step's cost), written once under `out`."""
    import numpy as np
    from PIL import Image

    folder = out / "edit_rows"
    if not (folder / "rows.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        ramp = np.linspace(0, 255, 384, dtype=np.uint8)
        for i in range(len(PROMPTS)):
            pixels = np.stack([np.add.outer(ramp, ramp) // 2, np.full((384, 384), 32 * i, np.uint8),
                               np.tile(ramp, (384, 1))], axis=-1).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"source_{i}.png")
        (folder / "rows.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"source_{i}.png"}) + "\n"
                                                   for i, p in enumerate(PROMPTS)))
    return folder / "rows.jsonl"


def run_case(name: str, folder: Path, model_type: str, args, source: str | None = None) -> dict:
    """One case in its own process; from the pixelrl under `source` (a `src` folder) when given."""
    family, config, overrides = CASES[name]
    if args.profile_step:
        overrides = overrides + [f"trainer.profile_step={args.profile_step}"]
    run_dir = Path(args.out) / "runs"
    label = f"{name}_baseline" if source else name
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pixelrl", "train", "--config-name", config, f"model.path={folder}",
           f"model.type={model_type}", f"trainer.total_training_steps={args.steps}", f"trainer.peak_tflops={args.peak_tflops}",
           f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name={label}", "trainer.resume_mode=disable",
           *([f"data.train_files=[{edit_rows(Path(args.out))}]"] if model_type in EDIT_TYPES else
             [f"data.prompts={json.dumps(PROMPTS)}", "data.train_files=[]"]), *COMMON, *overrides, *args.set]
    if args.scale == "tiny":
        cmd += TINY_OVERRIDES + (["diffusion_loss.params.num_timesteps=2"] if config.startswith("awm") else [])
    if args.device != "cuda":
        cmd.append(f"model.device={args.device}")
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, env=env)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        code, tail = "timeout", ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-3000:]
    result = {"case": label, "config": config, "overrides": overrides + args.set, "exit": code, "wall_s": round(time.time() - start, 1)}
    metrics = run_dir / "bench" / label / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    # the profiled step runs slower: it is not part of the steady state
    rows = [r for r in rows if "timing_s/step" in r and r.get("training/global_step") != args.profile_step]
    if rows:
        result.update(steady_state(rows))
    fitted = [line for line in tail.splitlines() if line.startswith("pixelrl: sized for")]
    if fitted:
        result["sized"] = fitted[-1].split(": ", 2)[-1]
    profile = run_dir / "bench" / label / "profile" / f"step_{args.profile_step}_rank_0.txt"
    if profile.exists():
        result["profile"] = str(profile)
    if code != 0:
        result["log_tail"] = tail
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_gpu")
    parser.add_argument("--cases", default="sd35,sd35_tuned,sd35_fast,wan", help=f"comma list of {list(CASES)} or all")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--scale", choices=("real", "tiny"), default="real")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case-timeout", type=float, default=600)
    parser.add_argument("--set", action="append", default=[], help="an override added to every case (repeatable)")
    parser.add_argument("--baseline-src", default=None,
                        help="a `src` folder of another pixelrl version: each case runs from it first, as "
                             "<case>_baseline, then from this one, on the same card")
    parser.add_argument("--profile-step", type=int, default=0,
                        help="profile this step of every case (trainer.profile_step); printed after the table")
    args = parser.parse_args()
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)} or all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = versions()
    print(json.dumps(env), flush=True)
    folders: dict[str, tuple[Path, str]] = {}
    import torch

    for name in names:
        family = CASES[name][0]
        if family not in folders:
            start = time.time()
            with torch.device(args.device if args.scale == "real" else "cpu"):
                torch.manual_seed(0)
                folders[family] = BUILDERS[family](out / "models" / family, tiny=args.scale == "tiny")
            if torch.cuda.is_available():  # the random weights are written: free them for the cases' processes
                torch.cuda.empty_cache()
            print(f"built {family} in {time.time() - start:.0f} s", flush=True)
        for source in ([args.baseline_src] if args.baseline_src else []) + [None]:
            result = run_case(name, *folders[family], args, source)
            result.update(env)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    print_table(results)
    for r in results:
        if r.get("sized"):
            print(f"{r['case']}: the `auto` sizes chose {r['sized']}")
        if r.get("profile"):
            print(f"\n{r['case']}: {r['profile']}\n" + Path(r["profile"]).read_text())


def print_table(results: list[dict]) -> None:
    print("| case | s/step | img/s | MFU | peak GB | estimated GB | fwd / bwd | phases (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "timing_s/step" not in r:
            print(f"| {r['case']} | failed ({r['exit']}) | | | | | | |")
            continue
        # the planner's estimate the `auto` sizes were chosen by (logged on a GPU only)
        estimated = r.get("perf/estimated_peak_memory_gb")
        phases = ", ".join(f"{k[9:]} {v:.1f}" for k, v in r.items() if k.startswith("timing_s/") and k != "timing_s/step")
        print(f"| {r['case']} | {r['timing_s/step']:.2f} | {r.get('perf/throughput', 0):.3f} | {r.get('perf/mfu', 0):.3f} | "
              f"{r.get('perf/peak_memory_gb', 0):.1f} | {'-' if estimated is None else f'{estimated:.1f}'} | "
              f"{r.get('perf/denoiser_forwards', 0):.0f} / "
              f"{r.get('perf/denoiser_backwards', 0):.0f} | {phases} |")


if __name__ == "__main__":
    main()
