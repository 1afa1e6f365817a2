"""`pixelrl` command line.

    pixelrl train [--config-name NAME] [key=value ...]   train (Ray, or trainer.backend=local)
    pixelrl export CHECKPOINT OUT [--adapter-only]      a diffusers pipeline (or adapter) folder
    pixelrl eval [--model PATH | --checkpoint DIR]      GenEval-style table on the shapes test set (--task text: OCR)
    pixelrl generate --prompt "..." [--model PATH]      an image grid (PNG)
    pixelrl pretrain-shapes OUT [--steps N] [--world text]  pretrain a shapes model from scratch
    pixelrl make-preferences OUT [--prompts FILE]       offline DPO pairs from a model's scored samples
    pixelrl demo [key=value ...]                        Flow-GRPO on the shipped shapes model, before/after
    pixelrl demo-jpeg                                   15-second Flow-GRPO run on a tiny random model
    pixelrl build-tiny PATH [--family F]                a tiny random SD3 / FLUX / Qwen-Image / Wan pipeline
    pixelrl pretrain-vlm OUT [--steps N]                pretrain the shapes-QA vision-language model
    pixelrl demo-vlm [key=value ...]                    GRPO on the shipped shapes-QA VLM, accuracy before/after
    pixelrl plot RUN [--keys PATTERN ...]               a run's metrics as a PNG, one panel per key
    pixelrl serve-reward --reward NAME [--host H]       a reward behind HTTP for `remote` rewards elsewhere
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pixelrl.core.paths import check_no_links_out, check_output_dir, check_output_file, image_suffixes
from pixelrl.core.quiet import quiet_libraries


def _number(kind, low: float, allow_low: bool):
    """An argparse type: a finite number above `low` (or equal to it when `allow_low`); argparse
    turns the ValueError into one line naming the flag, and exit code 2."""
    import math

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < low or (value == low and not allow_low):
            raise argparse.ArgumentTypeError(f"{text} is not a {'finite ' if kind is float else ''}number "
                                             f"{'>=' if allow_low else '>'} {low:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


positive_int = _number(int, 0, allow_low=False)
non_negative_int = _number(int, 0, allow_low=True)
non_negative_float = _number(float, 0.0, allow_low=True)
positive_float = _number(float, 0.0, allow_low=False)


def cmd_demo(args) -> int:
    import torch

    from pixelrl.demo import run_demo

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_demo(args.overrides, per_category=args.per_category, config_name=args.config_name)
    return 0


def cmd_demo_jpeg(args) -> int:
    """`configs/flow_grpo_tiny.yaml` through the regular trainer in one process, on a tiny random
    model built on first use, with a fixed-seed evaluation before and after."""
    import torch

    from pixelrl.core.config_loading import load_config
    from pixelrl.engine import PolicyEngine
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.evaluate import fixed_seed_reward
    from pixelrl.models import build_tiny_sd3
    from pixelrl.rewards import WeightedReward
    from pixelrl.trainers.policy_gradient import PolicyGradientTrainer

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
    result = PolicyGradientTrainer(cfg).fit()
    load_engine(engine, str(Path(result["run_dir"]) / "checkpoints" / f"global_step_{args.steps}" / "actor"))
    after = fixed_seed_reward(engine, reward, eval_prompts, eval_seeds)
    print(f"fixed-seed eval reward after:  {after:.4f}  (change {after - before:+.4f}) "
          f"in {time.time() - start:.0f} s")
    return 0


def cmd_train(args) -> int:
    from pixelrl.core.config_loading import load_config
    from pixelrl.trainers.policy_gradient import PolicyGradientTrainer

    cfg = load_config(args.config_name, args.overrides)
    if cfg.algorithm.trainer_type == "vlm_ppo":
        from pixelrl.trainers.vlm_ppo import VLMPPOTrainer

        history = VLMPPOTrainer(cfg).fit()["history"]
        if history:
            print(f"done: {len(history)} steps, reward/overall {history[0]['reward/overall']:.4f} -> "
                  f"{history[-1]['reward/overall']:.4f}")
        else:
            print("done: no steps left to train (the latest checkpoint is at trainer.total_training_steps)")
        return 0
    result = PolicyGradientTrainer(cfg).fit()
    history = result["history"]
    if history:
        first, last = history[0], history[-1]
        # offline DPO generates nothing during training: report its implicit accuracy instead
        key = "critic/rewards/mean" if "critic/rewards/mean" in first else "actor/implicit_acc"
        print(f"done: {len(history)} steps, {key} {first[key]:.4f} -> {last[key]:.4f}; run folder {result['run_dir']}")
    return 0


def cmd_export(args) -> int:
    from pixelrl.core.assets import resolve
    from pixelrl.core.config_loading import from_yaml_text
    from pixelrl.core.errors import ConfigError
    from pixelrl.models.export import export_checkpoint

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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("<out>", str(out), "exists and is " + ("a file" if not out.is_dir() else "not empty")
                          + ": export into a new or empty folder")
    check_output_dir(out, "<out>")
    saved = from_yaml_text((ckpt / "config.yaml").read_text()).model
    base = args.base_model or saved.path
    if not Path(resolve(str(base))).is_dir():
        raise ConfigError("--base-model", str(base), "the base model folder does not exist here (a run's relative "
                          "model.path is relative to where it trained): pass --base-model PATH")
    out = export_checkpoint(ckpt / "actor", base, out, model_type=saved.type, adapter_only=args.adapter_only)
    print(f"exported {'adapter' if args.adapter_only else 'pipeline'} to {out}")
    return 0


def cmd_eval(args) -> int:
    import json

    import torch

    from pixelrl.data.shapes import evaluation_items
    from pixelrl.engine.evaluate import (bootstrap_overall, diversity, evaluate_geneval, format_failures, format_table,
                                         load_for_eval)

    check_output_file(args.out, "--out", (".json",))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.task == "text":
        return _eval_text(args)
    model = load_for_eval(args.model, args.checkpoint)
    items = evaluation_items(args.split, per_category=args.per_category or 64, seed=args.seed)
    result = evaluate_geneval(model, items, num_steps=args.steps, guidance_scale=args.cfg)
    result["diversity"] = diversity(result.pop("images"), items)
    result.update(split=args.split, num_steps=args.steps, guidance_scale=args.cfg,
                  model=args.checkpoint or args.model or "builtin:shapes")
    for score in ("strict", "exact"):
        result[f"{score}_interval"] = bootstrap_overall(result["items"], score)
        print(format_table(result, Path(result["model"]).name, score))
    low, high = bootstrap_overall(result["items"], "partial")
    print(f"partial-credit overall {result['overall_partial']:.3f} [{low:.3f}, {high:.3f}]; unrequested objects "
          f"per image {result['extra_objects']:.2f}; diversity {result['diversity']}  ([a, b]: 95% bootstrap "
          "interval over items)")
    print("what went wrong (fraction of each category's images):")
    print(format_failures(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _eval_text(args) -> int:
    """`pixelrl eval --task text`: the OCR reward on the text world's items, with 95% intervals."""
    import json

    from pixelrl.core.errors import ConfigError
    from pixelrl.data import shapes_text
    from pixelrl.engine.evaluate import bootstrap_overall, evaluate_text, load_for_eval

    if args.split == "train":
        raise ConfigError("--split", args.split, "val or test for --task text (every word trains; the splits are seeds)")
    model_path = args.model or (None if args.checkpoint else "builtin:shapes_text")
    model = load_for_eval(model_path, args.checkpoint)
    items = shapes_text.evaluation_items(args.split, per_word=args.per_category, seed=args.seed)
    result = evaluate_text(model, items, num_steps=args.steps, guidance_scale=args.cfg)
    result.pop("images")
    name = Path(args.checkpoint).name if args.checkpoint else model_path
    cells = []
    for key in ("ocr", "exact"):
        low, high = bootstrap_overall(result["items"], key)
        cells.append(f"{result[key]:.3f} [{low:.3f}, {high:.3f}]")
    print("| model | ocr | exactly readable |\n|---|---|---|\n" + f"| {name} | " + " | ".join(cells) + " |")
    print(f"{len(items)} images ({len(items) // len(shapes_text.WORDS)} per word, {args.split} split); "
          "[a, b]: 95% bootstrap interval over items")
    result.update(split=args.split, num_steps=args.steps, guidance_scale=args.cfg, model=name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def cmd_plot(args) -> int:
    from pixelrl.core.errors import ConfigError
    from pixelrl.trainers.tracking import plot_metrics

    run = Path(args.run)
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    if not metrics.is_file():
        raise ConfigError("<run>", args.run, "a run folder holding metrics.jsonl (trainer.logger includes jsonl), "
                          "or the metrics.jsonl file itself")
    check_output_file(args.out, "--out", image_suffixes())
    keys = plot_metrics(metrics, args.keys, args.out, x=args.x)
    print(f"wrote {args.out}: {', '.join(keys)}")
    return 0


def cmd_generate(args) -> int:
    from PIL import Image

    from pixelrl.engine.evaluate import generate, load_for_eval
    from pixelrl.trainers.tracking import image_grid

    check_output_file(args.out, "--out", image_suffixes())
    model = load_for_eval(args.model, args.checkpoint)
    images = generate(model, [args.prompt] * args.n, list(range(args.seed, args.seed + args.n)),
                      num_steps=args.steps, guidance_scale=args.cfg)
    grid = image_grid(images.numpy(), ncols=min(8, args.n), scale=4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(args.out)
    print(f"wrote {args.n} images of {args.prompt!r} to {args.out}")
    return 0


def cmd_make_preferences(args) -> int:
    import torch

    from pixelrl.data.prompts import PromptDataset
    from pixelrl.engine.evaluate import load_for_eval
    from pixelrl.engine.preference_data import make_preferences
    from pixelrl.workers.group import RewardGroup

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    options = _reward_options(args)
    rows = PromptDataset.from_files([args.prompts]).rows
    rewards = RewardGroup([{"name": args.reward, "weight": 1.0, "options": options}], backend="local")
    summary = make_preferences(load_for_eval(args.model, args.checkpoint), rows, rewards, Path(args.out), n=args.n,
                               seed=args.seed, num_steps=args.steps, guidance_scale=args.cfg,
                               resolution=args.resolution, score_key=args.score, margin=args.margin,
                               max_pairs_per_prompt=args.pairs_per_prompt)
    print(f"{summary['pairs']} pairs from {summary['prompts_with_pairs']} of {summary['prompts']} prompts "
          f"({summary['images']} images); wrote {Path(args.out) / 'preferences.jsonl'}")
    return 0


def cmd_pretrain_shapes(args) -> int:
    import torch

    from pixelrl.shapes.pretrain import SHAPES_ARCH, pretrain_shapes

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    arch = dict(SHAPES_ARCH)
    if args.text_width:
        arch["text_hidden"] = args.text_width
    if args.text_layers:
        arch["text_layers"] = args.text_layers
    final = pretrain_shapes(args.out, steps=args.steps, seed=args.seed, eval_every=args.eval_every,
                            world=args.world, arch=arch, lr_schedule=args.lr_schedule,
                            log=lambda line: print(line, flush=True))
    print(f"final EMA pipeline: {final}")
    return 0


def cmd_pretrain_vlm(args) -> int:
    import torch

    from pixelrl.engine.pretrain_vlm import pretrain_shapes_qa

    torch.set_num_threads(args.threads)
    final = pretrain_shapes_qa(args.out, steps=args.steps, seed=args.seed, eval_every=args.eval_every,
                               log=lambda line: print(line, flush=True))
    print(f"final model folder: {final}")
    return 0


def cmd_demo_vlm(args) -> int:
    """configs/vlm_grpo_shapes_qa.yaml: held-out accuracy per question type before and after."""
    import torch

    from pixelrl.core.config_loading import load_config
    from pixelrl.data.shapes_qa import colour_only_accuracy
    from pixelrl.engine.pretrain_vlm import summarise_correctness
    from pixelrl.trainers.vlm_ppo import VLMPPOTrainer, task_items

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = load_config("vlm_grpo_shapes_qa", ["trainer.resume_mode=disable", "trainer.val_before_train=true",
                                             *args.overrides])
    print(f"pixelrl demo-vlm: GRPO on the shipped shapes-QA Qwen2-VL, {cfg.data.train_batch_size} questions x "
          f"{cfg.rollout.n} answers per step, {cfg.trainer.total_training_steps} steps; held-out accuracy on "
          f"{cfg.vlm.val_items} test questions (greedy)")
    start = time.time()
    result = VLMPPOTrainer(cfg, console=lambda line: None).fit()
    before, after = result["val"][0], result["val"][-1]
    minutes = (time.time() - start) / 60
    # balanced accuracy: a policy that gives one answer to every question of a type scores 1/K there;
    # colour only: what seeing colours but not shapes scores on the same questions
    reference = summarise_correctness([(it["type"], it["answer"], colour_only_accuracy(it))
                                       for it in task_items(cfg, "test", 0, cfg.vlm.val_items)])
    print(f"{'question type':<14}{'accuracy':>17}{'balanced accuracy':>22}{'colour only':>14}")
    print(f"{'':<14}{'before':>8}{'after':>9}{'before':>13}{'after':>9}")
    types = sorted(k[len("val/accuracy_"):] for k in before if k.startswith("val/accuracy_"))
    for name, plain, balanced in [(t, f"val/accuracy_{t}", f"val/balanced_accuracy_{t}") for t in types] + \
            [("overall", "val/accuracy", "val/balanced_accuracy")]:
        print(f"{name:<14}{before[plain]:>8.3f}{after[plain]:>9.3f}{before[balanced]:>13.3f}{after[balanced]:>9.3f}"
              f"{reference[plain.removeprefix('val/')]:>14.3f}")
    print(f"gain: {after['val/accuracy'] - before['val/accuracy']:+.3f} accuracy, "
          f"{after['val/balanced_accuracy'] - before['val/balanced_accuracy']:+.3f} balanced accuracy in "
          f"{minutes:.1f} min; run folder {result['run_dir']}")
    return 0


def _reward_options(args) -> dict:
    """`--reward-options` parsed as JSON and checked against `--reward`'s options."""
    import json

    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards.registry import check_reward_options

    from pixelrl.core.plugins import import_plugins
    from pixelrl.rewards import REWARDS

    import_plugins(args.plugin or [], field="--plugin")
    REWARDS.get(args.reward, field="--reward")  # unknown: the registry's error and plugins hint
    try:
        options = json.loads(args.reward_options)
    except json.JSONDecodeError as err:
        raise ConfigError("--reward-options", args.reward_options, f"not JSON ({err.msg})") from None
    if not isinstance(options, dict):
        raise ConfigError("--reward-options", args.reward_options, 'a JSON object, e.g. {"strict_weight": 0.5}')
    check_reward_options(args.reward, options, field="--reward-options")
    return options


def cmd_serve_reward(args) -> int:
    import pixelrl.rewards  # noqa: F401  (registers the rewards)
    from pixelrl.rewards.server import RewardServer
    from pixelrl.rewards.wire import Limits

    from pixelrl.core.errors import ConfigError

    if args.port > 65535:
        raise ConfigError("--port", args.port, "a TCP port in 0..65535 (0 picks a free one)")
    options = _reward_options(args)
    token = os.environ.get(args.token_env) or None
    server = RewardServer(args.reward, options, host=args.host, port=args.port, token=token,
                          max_request_mb=args.max_request_mb, token_env=args.token_env,
                          limits=Limits(max_images=args.max_images, max_pixels=args.max_pixels))
    print(f"serving reward `{args.reward}` at {server.url} (POST /score, GET /health; "
          f"{'bearer token from $' + args.token_env if token else 'no token: loopback only'}); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


def cmd_build_tiny(args) -> int:
    from pixelrl.core.errors import ConfigError

    if args.family != "sd3" and (args.no_vae or args.no_t5):
        raise ConfigError("--family", args.family, "only SD3 folders can leave out the VAE or T5: drop --no-vae / --no-t5")
    if args.family == "flux":
        from pixelrl.models.flux import build_tiny_flux

        path = build_tiny_flux(args.path, resolution=args.resolution, seed=args.seed)
    elif args.family == "wan":
        from pixelrl.models.wan import build_tiny_wan

        path = build_tiny_wan(args.path, seed=args.seed)
    elif args.family == "qwen_image":
        from pixelrl.models.qwen_image import build_tiny_qwen_image

        path = build_tiny_qwen_image(args.path, resolution=args.resolution, seed=args.seed)
    else:
        from pixelrl.models import build_tiny_sd3

        path = build_tiny_sd3(args.path, resolution=args.resolution, with_vae=not args.no_vae,
                              with_t5=not args.no_t5, seed=args.seed)
    print(f"wrote a tiny {args.family} pipeline to {path}")
    return 0


# convert-reward: the reward, its converter's module, the released file, and the base folder it needs
CONVERTIBLE_REWARDS = {
    "image_reward": ("pixelrl.rewards.image_reward", "ImageReward.pt",
                     "a local transformers BLIP image-text-matching folder of ViT-L size (config.json, tokenizer "
                     "and preprocessor files), e.g. a copy of blip-itm-large-coco"),
    "hpsv2": ("pixelrl.rewards.hps", "HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt)",
              "a local transformers copy of CLIP-ViT-H-14-laion2B-s32B-b79K (config.json, tokenizer and "
              "preprocessor files)"),
}


def cmd_convert_reward(args) -> int:
    import importlib

    from pixelrl.core.errors import ConfigError

    module, released, base = CONVERTIBLE_REWARDS[args.reward]
    if not Path(args.checkpoint).is_file():
        raise ConfigError("<checkpoint>", args.checkpoint, f"the released {released} file (a local copy)")
    if Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
        raise ConfigError("<out>", args.out, "an empty or new folder (nothing is overwritten)")
    if not (Path(args.base) / "config.json").is_file():
        raise ConfigError("--base", args.base, base)
    out = importlib.import_module(module).convert_checkpoint(args.checkpoint, args.base, args.out)
    print(f"wrote {out}: use it as reward.functions=[{{name: {args.reward}, options: {{path: {out}}}}}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pixelrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train with a config and dotted overrides")
    train.add_argument("--config-name", default=None, help="a config in configs/ or a YAML path")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8")
    train.set_defaults(func=cmd_train)
    plot = sub.add_parser("plot", help="plot a run's metrics (one panel per matching key) to a PNG")
    plot.add_argument("run", help="a run folder (with metrics.jsonl) or a metrics.jsonl file")
    plot.add_argument("--keys", nargs="+", default=["val-core/*", "val/*", "critic/rewards/mean", "reward/overall"],
                      help="metric names or shell patterns, e.g. 'val-core/*/gold/*'")
    plot.add_argument("--out", default="metrics.png")
    plot.add_argument("--x", choices=("step", "minutes", "images"), default="step")
    plot.set_defaults(func=cmd_plot)
    export = sub.add_parser("export", help="export a checkpoint for diffusers")
    export.add_argument("checkpoint", help="a <run>/checkpoints/global_step_N folder")
    export.add_argument("out")
    export.add_argument("--adapter-only", action="store_true", help="write only the LoRA adapter")
    export.add_argument("--base-model", default=None, help="base pipeline folder (default: the run's model.path)")
    export.set_defaults(func=cmd_export)
    for name, helptext in (("eval", "GenEval-style per-category table on the shapes test set"),
                           ("generate", "write an image grid for a prompt")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", default=None,
                       help="pipeline folder (default: builtin:shapes, with --task text builtin:shapes_text)")
        p.add_argument("--checkpoint", default=None, help="a global_step_N folder of a training run")
        p.add_argument("--steps", type=positive_int, default=10)
        p.add_argument("--cfg", type=non_negative_float, default=4.0, help="guidance scale")
        p.add_argument("--seed", type=non_negative_int, default=0)
        if name == "eval":
            p.add_argument("--split", default="test", choices=["train", "val", "test"])
            p.add_argument("--per-category", type=positive_int, default=None,
                           help="items per category (per word with --task text); default 64 (8)")
            p.add_argument("--task", choices=["scenes", "text"], default="scenes",
                           help="scenes: GenEval-style tables; text: the OCR reward on the text world (a sign that says \"sun\")")
            p.add_argument("--out", default="runs/eval/results.json")
            p.set_defaults(func=cmd_eval)
        else:
            p.add_argument("--prompt", required=True)
            p.add_argument("--n", type=positive_int, default=8)
            p.add_argument("--out", default="runs/generate/grid.png")
            p.set_defaults(func=cmd_generate)
    pre = sub.add_parser("pretrain-shapes", help="pretrain the shapes model (flow matching on renders); "
                         "run again on the same folder to resume from its last evaluation")
    pre.add_argument("out")
    pre.add_argument("--steps", type=positive_int, default=6000)
    pre.add_argument("--seed", type=non_negative_int, default=0)
    pre.add_argument("--eval-every", type=positive_int, default=1500)
    pre.add_argument("--world", choices=["scenes", "text"], default="scenes",
                     help='scenes: GenEval-style prompts (builtin:shapes); text: a sign that says "sun", for the ocr reward')
    pre.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                     help="cosine: decay the learning rate to 0 at --steps (a cosine run cannot be extended)")
    pre.add_argument("--text-width", type=positive_int, default=None,
                     help="width of each of the two CLIP text encoders (default: the first shipped model's, 64)")
    pre.add_argument("--text-layers", type=positive_int, default=None,
                     help="layers of each CLIP text encoder (default: the first shipped model's, 2)")
    pre.set_defaults(func=cmd_pretrain_shapes)
    prefs = sub.add_parser("make-preferences", help="sample a model, score, and write (chosen, rejected) pairs")
    prefs.add_argument("out", help="folder for preferences.jsonl and images/")
    prefs.add_argument("--model", default=None, help="pipeline folder (default: builtin:shapes)")
    prefs.add_argument("--checkpoint", default=None, help="a global_step_N folder of a training run")
    prefs.add_argument("--prompts", default="builtin:shapes/train_balanced", help="a prompt file (.jsonl/.parquet/.txt)")
    prefs.add_argument("--n", type=positive_int, default=8, help="images per prompt")
    prefs.add_argument("--steps", type=positive_int, default=10)
    prefs.add_argument("--cfg", type=non_negative_float, default=1.0, help="guidance scale")
    prefs.add_argument("--resolution", type=positive_int, default=32)
    prefs.add_argument("--seed", type=non_negative_int, default=0)
    prefs.add_argument("--reward", default="shapes_geneval")
    prefs.add_argument("--plugin", action="append", help="a module or .py file registering your reward (repeatable)")
    prefs.add_argument("--reward-options", default="{}", help="the reward's options as JSON")
    prefs.add_argument("--score", default="shapes_strict", help="the reward output that ranks images")
    prefs.add_argument("--margin", type=non_negative_float, default=1.0, help="least score difference of a pair")
    prefs.add_argument("--pairs-per-prompt", type=positive_int, default=2)
    prefs.set_defaults(func=cmd_make_preferences)
    serve = sub.add_parser("serve-reward", help="serve a registered reward over HTTP (JSON + PNG, never pickle)")
    serve.add_argument("--reward", required=True, help="a registered reward name, e.g. ocr or shapes_geneval")
    serve.add_argument("--reward-options", default="{}", help="the reward's options as JSON")
    serve.add_argument("--plugin", action="append", help="a module or .py file registering your reward (repeatable)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (a non-loopback one needs a token)")
    serve.add_argument("--port", type=non_negative_int, default=8765)
    serve.add_argument("--token-env", default="PIXELRL_REWARD_TOKEN",
                       help="environment variable holding the bearer token (never pass it on the command line)")
    serve.add_argument("--max-request-mb", type=positive_float, default=64.0)
    serve.add_argument("--max-images", type=positive_int, default=1024, help="images per request")
    serve.add_argument("--max-pixels", type=positive_int, default=4096 * 4096, help="pixels per image")
    serve.set_defaults(func=cmd_serve_reward)
    demo = sub.add_parser("demo", help="Flow-GRPO on the shipped shapes model with a before/after evaluation")
    demo.add_argument("--config-name", default="shapes_flow_grpo",
                      help="a shapes config (shapes_flow_grpo_long: the 100-minute long run)")
    demo.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    demo.add_argument("--per-category", type=positive_int, default=64, help="held-out evaluation items per category")
    demo.set_defaults(func=cmd_demo)
    jpeg = sub.add_parser("demo-jpeg", help="short Flow-GRPO run on a tiny random model with the JPEG reward")
    jpeg.add_argument("--steps", type=positive_int, default=20)
    jpeg.add_argument("--seed", type=non_negative_int, default=0)
    jpeg.add_argument("--run-dir", default="runs/demo")
    jpeg.set_defaults(func=cmd_demo_jpeg)
    convert = sub.add_parser("convert-reward", help="a released reward checkpoint + its local base folder -> a "
                             "reward folder (image_reward, hpsv2)")
    convert.add_argument("reward", choices=sorted(CONVERTIBLE_REWARDS))
    convert.add_argument("checkpoint", help="the released .pt file (read as tensors only)")
    convert.add_argument("out")
    convert.add_argument("--base", required=True, help="the local transformers folder of the base model "
                         "(config, tokenizer, processor)")
    convert.set_defaults(func=cmd_convert_reward)
    pre_vlm = sub.add_parser("pretrain-vlm", help="pretrain the shapes-QA vision-language model (supervised)")
    pre_vlm.add_argument("out")
    pre_vlm.add_argument("--steps", type=positive_int, default=125)
    pre_vlm.add_argument("--seed", type=non_negative_int, default=0)
    pre_vlm.add_argument("--eval-every", type=positive_int, default=25)
    pre_vlm.add_argument("--threads", type=positive_int, default=1, help="torch threads (1 reproduces the shipped model)")
    pre_vlm.set_defaults(func=cmd_pretrain_vlm)
    demo_vlm = sub.add_parser("demo-vlm", help="GRPO on the shipped shapes-QA VLM with accuracy before/after")
    demo_vlm.add_argument("overrides", nargs="*", help="key=value overrides of configs/vlm_grpo_shapes_qa.yaml")
    demo_vlm.set_defaults(func=cmd_demo_vlm)
    tiny = sub.add_parser("build-tiny", help="write a tiny random pipeline folder (SD3, FLUX, Qwen-Image or Wan)")
    tiny.add_argument("path")
    tiny.add_argument("--family", choices=["sd3", "flux", "qwen_image", "wan"], default="sd3", help="the model family (model.type)")
    tiny.add_argument("--resolution", type=positive_int, default=32)
    tiny.add_argument("--no-vae", action="store_true", help="pixel space (diffusers then needs vae=None)")
    tiny.add_argument("--no-t5", action="store_true", help="CLIP only (diffusers then needs text_encoder_3=None)")
    tiny.add_argument("--seed", type=non_negative_int, default=0)
    tiny.set_defaults(func=cmd_build_tiny)
    args = parser.parse_args(argv)
    quiet_libraries()
    import warnings

    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecation notice
    from pixelrl.core.errors import PixelRLError

    try:
        return args.func(args)
    except PixelRLError as err:
        print(f"pixelrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pixelrl: interrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
