"""`pixelrl plan` on every SD3.5, FLUX, FLUX.1 Kontext, Qwen-Image, Qwen-Image-Edit and Wan paper config for 1, 2 and 8 GPUs, as the
markdown table in docs/planning.md ("Every paper config on 1, 2 and 8 GPUs of 80 GB").

    python benchmarks/plan_paper_configs.py [--gpu-memory 80] [--peak-tflops 989] [--gpus 1,2,8]

No GPU needed: the models' published shapes stand in for folders that are not here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "pixelrl" / "configs"
ORDER = ("_sd35", "_flux", "_flux_kontext", "_qwen_image", "_qwen_image_edit", "_wan")  # families in this order


def paper_configs() -> list[str]:
    names = [p.stem for p in CONFIGS.glob("*.yaml")]
    return [n for suffix in ORDER for n in sorted(names) if n.endswith(suffix)]


def row(name: str, gpus: int, gpu_memory: float, peak: float) -> str:
    from pixelrl.config.plan import plan_for
    from pixelrl.config.validation import compose_config
    from pixelrl.engine.config import images_per_step
    from pixelrl.core.errors import ConfigError

    cfg = compose_config(name, [])
    try:
        plan = plan_for(cfg, gpus, gpu_memory, peak)
    except ConfigError as err:
        return f"| `{name}` | | {gpus} | refused: {err} | | | | | | | |"
    c, e = plan.choice, plan.estimate
    per_gpu_images = images_per_step(cfg) / gpus / e.step_s  # as `pixelrl plan` prints it: communication apart
    model = plan.shape.name.removesuffix(" (published shape)")
    return (f"| `{name}` | {model} | {gpus} | {c.strategy or cfg.trainer.strategy} | "
            f"{cfg.actor.ppo_micro_batch_size} -> {c.micro_batch} | "
            f"{str(cfg.model.gradient_checkpointing).lower()} -> {str(c.checkpointing).lower()} | "
            f"{cfg.rollout.micro_batch_size} -> {c.sampling_micro_batch} | {e.peak_gb:.0f} | {e.step_s:.0f} | "
            f"{per_gpu_images:.2f} | {e.communication_gb:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--gpus", default="1,2,8")
    args = parser.parse_args()
    print("| config | model | GPUs | strategy | micro-batch | checkpointing | sampling micro-batch | peak GB / GPU | "
          "s / step | img/s / GPU | communication GB / GPU / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in paper_configs():
        for gpus in (int(g) for g in args.gpus.split(",")):
            print(row(name, gpus, args.gpu_memory, args.peak_tflops), flush=True)


if __name__ == "__main__":
    main()
