"""Training and its artefacts: `train`, `plot`, `report`, `export`, `demo-jpeg`, `build-tiny`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pixelrl.cli.arguments import non_negative_int, positive_float, positive_int
from pixelrl.core.paths import check_no_links_out, check_output_dir, check_output_file, image_suffixes


def cmd_train(args) -> int:
    from pixelrl.config import load_config
    from pixelrl.trainers.restarts import fit_with_restarts

    cfg = load_config(args.config_name, args.overrides)
    from pixelrl.config.evidence import evidence_line

    evidence = [line] if (line := evidence_line(args.config_name)) else []

    def console(text: str) -> None:  # what stands behind a shipped recipe, above the run's first line
        while evidence:
            print(evidence.pop())
        print(text)

    try:
        result = fit_with_restarts(cfg, console=console)
    except KeyboardInterrupt:
        from pixelrl.trainers.run_folder import interruption_summary, run_dir_of

        print(f"pixelrl: interrupted; {interruption_summary(run_dir_of(cfg), cfg.trainer.save_freq)}",
              file=sys.stderr)
        return 130
    history = result["history"]
    if not history:
        print("done: no steps left to train (the latest checkpoint is at trainer.total_training_steps)")
        return 0
    from pixelrl.config.sections import training_metrics_of

    first, last = history[0], history[-1]
    key = next((k for k in training_metrics_of(cfg.algorithm.trainer_type) if k in first and k in last), None)
    moved = f", {key} {first[key]:.4f} -> {last[key]:.4f}" if key else ""
    print(f"done: {len(history)} steps{moved}; run folder {result['run_dir']}")
    return 0


def cmd_plan(args) -> int:
    from pixelrl.config.plan import describe, plan_for
    from pixelrl.config.validation import compose_config

    cfg = compose_config(args.config_name, args.overrides)
    plan = plan_for(cfg, args.gpus, args.gpu_memory, args.peak_tflops, link_gb_per_s=args.link_gb_per_s)
    print(describe(cfg, plan, args.config_name))
    return 0


def cmd_reproduce(args) -> int:
    """Rerun reproducibility standards and compare each with its committed record (exit 1 when
    one differs beyond the tolerance, or with --exact at all), or write the records (`--record`)."""
    import tempfile

    from pixelrl.shapes.standards import STANDARDS, reproduce

    names = list(STANDARDS) if "all" in args.names else list(dict.fromkeys(args.names))
    if args.workdir:
        check_output_dir(args.workdir, "--workdir")
    with tempfile.TemporaryDirectory(prefix="pixelrl_reproduce_") as scratch:
        ran_on, results = reproduce(names, Path(args.workdir or scratch), record=args.record)
    print("reproduce on " + ", ".join(f"{k} {v}" for k, v in ran_on.items()))
    failed = 0
    for name, result in results.items():
        if args.record:
            print(f"{name:10s} recorded: {result}")
            continue
        failed += not (result.bitwise if args.exact else result.passed)
        print(f"{name:10s} {result.verdict()}  ({STANDARDS[name].what})")
    return 1 if failed else 0


def cmd_config(args) -> int:
    """The resolved config as YAML (defaults, the config chain and the overrides merged), then
    whether it validates on this machine: one error naming the field, as `train` would stop."""
    from pixelrl.config.validation import compose_config, validate
    from pixelrl.core.config_io import saved_yaml

    cfg = compose_config(args.config_name, args.overrides)
    print(saved_yaml(cfg), end="")
    validate(cfg)  # a ConfigError here is printed by main() with exit code 2
    print(f"# valid on this machine: pixelrl train --config-name {args.config_name or '<defaults>'} "
          + " ".join(args.overrides))
    return 0


def cmd_plot(args) -> int:
    from pixelrl.core.errors import ConfigError
    from pixelrl.trainers.tracking import plot_metrics

    run = Path(args.run)
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    if not metrics.is_file():
        raise ConfigError("<run>", args.run, "a run folder holding metrics.jsonl (trainer.logger includes jsonl), "
                          "or the metrics.jsonl file itself")
    out = args.out or str(metrics.parent / "metrics.png")  # beside the run's metrics, not where the shell is
    check_output_file(out, "--out", image_suffixes())
    keys = plot_metrics(metrics, args.keys, out, x=args.x)
    print(f"wrote {out}: {', '.join(keys)}")
    return 0


def cmd_report(args) -> int:
    from pixelrl.core.errors import ConfigError
    from pixelrl.trainers.report import write_report

    run = Path(args.run)
    if not (run / "metrics.jsonl").is_file() and not (run / "config.yaml").is_file():
        raise ConfigError("<run>", args.run, "a run folder (it holds config.yaml and metrics.jsonl): "
                          "<trainer.default_local_dir>/<project_name>/<experiment_name>")
    out = Path(args.out) if args.out else run / "report.html"
    check_output_file(str(out), "--out", (".html",))
    print(f"wrote {write_report(run, out)}: open it in a browser (self-contained, works offline)")
    return 0


def cmd_export(args) -> int:
    from pixelrl.core.assets import resolve
    from pixelrl.config.sections import from_yaml_text
    from pixelrl.core.errors import ConfigError
    from pixelrl.models.export import SAMPLER_FILE, export_checkpoint, write_sampler
    from pixelrl.models.loader import DECLARABLE_OPTIONS

    ckpt = Path(args.checkpoint)
    if (ckpt / "checkpoints").is_dir():
        steps = sorted((p.name for p in (ckpt / "checkpoints").glob("global_step_*") if p.is_dir()),
                       key=lambda name: int(name.rsplit("_", 1)[1]) if name.rsplit("_", 1)[1].isdigit() else -1)
        raise ConfigError("<checkpoint>", str(ckpt), "is a run folder: give one of its checkpoints, e.g. "
                          f"{ckpt / 'checkpoints' / (steps[-1] if steps else 'global_step_N')}")
    if not (ckpt / "config.yaml").is_file() or not (ckpt / "actor").is_dir():
        raise ConfigError("<checkpoint>", str(ckpt), "give a complete global_step_N checkpoint folder (it holds "
                          "config.yaml and actor/)")
    check_no_links_out(ckpt, "<checkpoint>")
    out = Path(args.out)
    holder = ckpt.resolve().parent if ckpt.resolve().parent.name == "checkpoints" else ckpt.resolve()
    if out.resolve().is_relative_to(holder):
        raise ConfigError("<out>", str(out), f"is inside {holder}, which checkpoint rotation "
                          "(trainer.max_ckpt_to_keep) deletes from: export outside the run's checkpoints folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("<out>", str(out), "exists and is " + ("a file" if not out.is_dir() else "not empty")
                          + ": export into a new or empty folder")
    check_output_dir(out, "<out>")
    run = from_yaml_text((ckpt / "config.yaml").read_text())
    saved = run.model
    if args.weights == "ema" and saved.type != "qwen_vl" and not run.actor.ema_decay:
        raise ConfigError("--weights", args.weights, "the run kept no EMA of its weights (actor.ema_decay was 0): "
                          "export its weights with --weights actor or without --weights")
    base = args.base_model or saved.path
    if not Path(resolve(str(base))).is_dir():
        raise ConfigError("--base-model", str(base), "the base model folder does not exist here (a run's relative "
                          "model.path is relative to where it trained): pass --base-model PATH")
    if saved.type == "qwen_vl":
        from pixelrl.vlm.export import export_vlm_checkpoint

        if args.adapter_only:
            raise ConfigError("--adapter-only", True, "a vision-language checkpoint exports as a whole Qwen2-VL folder "
                              "with the LoRA merged: drop --adapter-only")
        # by default the weights the run's validation scored: its EMA when it validated the EMA
        weights = args.weights or ("ema" if run.vlm.validate_ema else "actor")
        out = export_vlm_checkpoint(ckpt / "actor", resolve(str(base)), out, lora_rank=saved.lora_rank,
                                    lora_alpha=saved.lora_alpha, weights=weights)
        print(f"exported Qwen2-VL model folder ({weights} weights) to {out}")
        return 0
    # the exported folder declares the options the run trained with: a shapes model trained with
    # zero T5 tokens and loaded with the family default scores far worse, with no error
    trained_options = {option: getattr(saved, option) for option in DECLARABLE_OPTIONS}
    # by default the weights the run's validation scored: their EMA when it kept one
    weights = args.weights or ("ema" if run.actor.ema_decay > 0 else "actor")
    out = export_checkpoint(ckpt / "actor", base, out, model_type=saved.type, adapter_only=args.adapter_only,
                            trained_options=trained_options, weights=weights)
    from pixelrl.cli.shapes import run_sampler

    sampler = run_sampler(run, resolve(str(base)))
    write_sampler(out, sampler)
    print(f"exported {'adapter' if args.adapter_only else 'pipeline'} ({weights} weights) to {out}, with how the "
          f"run sampled it in {SAMPLER_FILE}; in plain diffusers:")
    from pixelrl.models.export import diffusers_example
    from pixelrl.models.loader import model_family

    example = diffusers_example(model_family(saved.type), out, sampler, run.rollout.resolution,
                                saved.max_sequence_length, base=resolve(str(base)) if args.adapter_only else None)
    print("\n".join("    " + line for line in example.splitlines()))
    return 0


def cmd_demo_jpeg(args) -> int:
    """`configs/flow_grpo_tiny.yaml` through the regular trainer in one process, on a tiny random
    model built on first use, with a fixed-seed evaluation before and after."""
    import torch

    from pixelrl.config import load_config
    from pixelrl.engine import PolicyEngine
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.evaluate import fixed_seed_reward
    from pixelrl.models import build_tiny_sd3
    from pixelrl.rewards import WeightedReward
    from pixelrl.trainers.controller import DiffusionTrainer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_dir = Path(args.run_dir)
    model_dir = run_dir / "tiny_sd3"
    if not (model_dir / "model_index.json").is_file():
        build_tiny_sd3(model_dir, resolution=32, with_vae=False, with_t5=False, seed=args.seed)
    cfg = load_config("flow_grpo_tiny", [f"model.path={model_dir}", f"seed={args.seed}", "trainer.backend=local",
                                         f"trainer.total_training_steps={args.steps}", "trainer.resume_mode=disable",
                                         f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl]"])
    engine, reward = PolicyEngine.from_config(cfg), WeightedReward.from_functions(cfg.reward.functions)
    eval_prompts = list(cfg.data.prompts) * 2
    eval_seeds = list(range(10_000, 10_000 + len(eval_prompts)))
    print(f"pixelrl demo: Flow-GRPO on a tiny random SD3 model ({model_dir}), reward = JPEG compressibility "
          f"(-kB at quality 95), {cfg.data.train_batch_size} prompts x {cfg.rollout.n} images per step")
    before = fixed_seed_reward(engine, reward, eval_prompts, eval_seeds)
    print(f"fixed-seed eval reward before: {before:.4f}")
    start = time.time()
    result = DiffusionTrainer(cfg).fit()
    load_engine(engine, str(Path(result["run_dir"]) / "checkpoints" / f"global_step_{args.steps}" / "actor"))
    after = fixed_seed_reward(engine, reward, eval_prompts, eval_seeds)
    print(f"fixed-seed eval reward after:  {after:.4f}  (change {after - before:+.4f}) "
          f"in {time.time() - start:.0f} s")
    return 0


def cmd_build_tiny(args) -> int:
    from pixelrl.core.errors import ConfigError
    from pixelrl.models.loader import family_spec

    spec = family_spec(args.family, field="--family")
    if spec.build_tiny is None:
        raise ConfigError("--family", args.family, "this family has no tiny builder; build its folder with diffusers")
    options = {"with_vae": not args.no_vae, "with_t5": not args.no_t5}
    dropped = [flag for flag, option in (("--no-vae", "with_vae"), ("--no-t5", "with_t5"))
               if not options[option] and option not in spec.tiny_options]
    if dropped:
        raise ConfigError("--family", args.family, f"this family's tiny folder cannot take {' / '.join(dropped)}: drop it")
    from pixelrl.core.paths import check_output_dir

    check_output_dir(args.path, "<path>")
    path = spec.build_tiny(args.path, resolution=args.resolution, seed=args.seed,
                           **{k: v for k, v in options.items() if k in spec.tiny_options})
    print(f"wrote a tiny {args.family} pipeline to {path}")
    return 0


def add_parsers(sub) -> None:
    from pixelrl.core.config_io import CONFIG_DIR

    configs = " ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    train = sub.add_parser("train", help="train with a config and dotted overrides",
                           epilog=f"configs shipped with pixelrl (configs/, the pages of docs/algorithms/ say what "
                                  f"each reproduces): {configs}")
    train.add_argument("--config-name", default=None, help="a config in configs/ or a YAML path")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8")
    train.set_defaults(func=cmd_train)
    config = sub.add_parser("config", help="print the resolved config (defaults, config and overrides merged) and "
                            "check it, without starting a run")
    config.add_argument("--config-name", default=None, help="a config in configs/ or a YAML path")
    config.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8")
    config.set_defaults(func=cmd_config)
    plan = sub.add_parser("plan", help="fit a recipe to your GPUs: micro-batches and checkpointing from an estimate "
                          "of memory and step time, the algorithm's batch sizes kept")
    plan.add_argument("--config-name", default=None, help="a config in configs/ or a YAML path")
    plan.add_argument("--gpus", type=positive_int, required=True, help="GPUs to train on (one worker each)")
    plan.add_argument("--gpu-memory", type=positive_float, required=True, help="memory of each GPU in GB, e.g. 80")
    plan.add_argument("--peak-tflops", type=positive_float, default=989.0,
                      help="each GPU's dense bf16 peak in TFLOP/s (989: H100 / H200 SXM; 312: A100)")
    plan.add_argument("--link-gb-per-s", type=positive_float, default=350.0,
                      help="collective bandwidth per GPU in GB/s (350: NVLink in one H100 node; ~45 across nodes "
                           "on 400 Gb/s InfiniBand)")
    plan.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=/models/sd35")
    plan.set_defaults(func=cmd_plan)
    from pixelrl.shapes.standards import STANDARDS

    reproduce = sub.add_parser("reproduce", help="rerun a reproducibility standard (a 3-step tiny-model run of one "
                               "trainer kind) and compare every learning metric with its committed record",
                               description="Exit code 0 when every value is equal or within the tolerance, "
                               "1 when one differs beyond it; docs/runtime.md says what is bitwise where.")
    reproduce.add_argument("names", nargs="+", choices=[*STANDARDS, "all"], metavar="NAME",
                           help=f"standards ({', '.join(STANDARDS)}), or all")
    reproduce.add_argument("--record", action="store_true", help="write the records from this machine instead")
    reproduce.add_argument("--exact", action="store_true", help="fail unless every value is bitwise equal")
    reproduce.add_argument("--workdir", default=None, help="keep the tiny models and runs here (default: a "
                           "temporary folder, removed)")
    reproduce.set_defaults(func=cmd_reproduce)
    plot = sub.add_parser("plot", help="plot a run's metrics (one panel per matching key) to a PNG")
    plot.add_argument("run", help="a run folder (with metrics.jsonl) or a metrics.jsonl file")
    plot.add_argument("--keys", nargs="+", default=["val-core/*", "val/*", "critic/rewards/mean"],
                      help="metric names or shell patterns, e.g. 'val-core/*/gold/*'")
    plot.add_argument("--out", help="the image to write (default: metrics.png in the run folder)")
    plot.add_argument("--x", choices=("step", "minutes", "images"), default="step", help="the horizontal axis")
    plot.set_defaults(func=cmd_plot)
    report = sub.add_parser("report", help="one self-contained HTML page of a run: curves, sample grids, validation "
                            "scores, held-out tables, timings, config", description="Write RUN/report.html (or --out) "
                            "from the files the run wrote; it opens offline in any browser.")
    report.add_argument("run", help="a run folder, <trainer.default_local_dir>/<project_name>/<experiment_name>")
    report.add_argument("--out", default=None, help="the HTML file to write (default: RUN/report.html)")
    report.set_defaults(func=cmd_report)
    export = sub.add_parser("export", help="export a checkpoint for diffusers (from a vision-language run: a "
                            "Qwen2-VL folder)")
    export.add_argument("checkpoint", help="a <run>/checkpoints/global_step_N folder")
    export.add_argument("out", help="a new or empty folder to write to")
    export.add_argument("--adapter-only", action="store_true", help="write only the LoRA adapter")
    export.add_argument("--base-model", default=None, help="base pipeline folder (default: the run's model.path)")
    export.add_argument("--weights", choices=("actor", "ema"), default=None,
                        help="the trained weights or their EMA (default: what the run validated)")
    export.set_defaults(func=cmd_export)
    jpeg = sub.add_parser("demo-jpeg", help="short Flow-GRPO run on a tiny random model with the JPEG reward")
    jpeg.add_argument("--steps", type=positive_int, default=20, help="training steps")
    jpeg.add_argument("--seed", type=non_negative_int, default=0, help="seeds the tiny model and the run")
    jpeg.add_argument("--run-dir", default="runs/demo", help="where the tiny model and the run go")
    jpeg.set_defaults(func=cmd_demo_jpeg)
    tiny = sub.add_parser("build-tiny", help="write a tiny random pipeline folder (SD3, FLUX, FLUX Kontext, Qwen-Image or Wan)")
    tiny.add_argument("path", help="the folder to write the pipeline to")
    tiny.add_argument("--family", default="sd3", help="the model family (model.type): sd3, flux, flux_kontext, qwen_image, qwen_image_edit, wan")
    tiny.add_argument("--resolution", type=positive_int, default=32, help="the image size it samples by default")
    tiny.add_argument("--no-vae", action="store_true", help="pixel space (diffusers then needs vae=None)")
    tiny.add_argument("--no-t5", action="store_true", help="CLIP only (diffusers then needs text_encoder_3=None)")
    tiny.add_argument("--seed", type=non_negative_int, default=0, help="seeds the random weights")
    tiny.set_defaults(func=cmd_build_tiny)
