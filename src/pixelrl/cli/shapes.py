"""The shapes world: `demo`, `demo-distill`, `demo-edit`, `eval`, `generate`, `pretrain-shapes`, `make-preferences`,
`make-demonstrations`."""

from __future__ import annotations

import os
from pathlib import Path

from pixelrl.cli.arguments import non_negative_float, non_negative_int, positive_float, positive_int
from pixelrl.cli.rewards import reward_options
from pixelrl.core.paths import check_output_dir, check_output_file, image_suffixes


def cmd_demo(args) -> int:
    import torch

    from pixelrl.shapes.demo import run_demo

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_demo(args.overrides, per_category=args.per_category, config_name=args.config_name)
    return 0


def cmd_demo_distill(args) -> int:
    import torch

    from pixelrl.shapes.distill_demo import run_distill_demo

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_distill_demo(args.overrides, per_category=args.per_category, teacher=args.teacher)
    return 0


def cmd_demo_edit(args) -> int:
    import torch

    from pixelrl.shapes.edit_demo import run_edit_demo

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_edit_demo(args.overrides, per_edit=args.per_edit)
    return 0


def cmd_eval(args) -> int:
    import torch

    from pixelrl.shapes.world import evaluation_items
    from pixelrl.engine.evaluate import diversity
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.shapes.evaluate import bootstrap_overall, evaluate_geneval, format_careful, format_failures, format_table

    check_output_file(args.out, "--out", (".json",))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.task != "scenes":
        if args.baseline and args.task == "text":
            from pixelrl.core.errors import ConfigError

            raise ConfigError("--baseline", args.baseline, "paired comparisons are of the scenes and edit tasks: drop "
                              "--task text")
        return _eval_text(args) if args.task == "text" else _eval_edit(args)
    items = evaluation_items(args.split, per_category=args.per_category or 64, seed=args.seed)
    baseline = _read_baseline(args.baseline, items) if args.baseline else None  # before the model loads
    model = load_for_eval(args.model, args.checkpoint)
    sampling = sampling_options(args, model)
    if baseline is not None:
        _check_baseline_sampling(args.baseline, baseline, sampling)
    result = evaluate_geneval(model, items, progress=True, **sampling)
    result["diversity"] = diversity(result.pop("images"), items)
    result.update(split=args.split, **sampling, model=args.checkpoint or args.model or "builtin:shapes")
    for score in ("strict", "exact"):
        result[f"{score}_interval"] = bootstrap_overall(result["items"], score)
        print(format_table(result, Path(result["model"]).name, score))
    print(format_careful(result))
    low, high = bootstrap_overall(result["items"], "partial")
    print(f"partial-credit overall {result['overall_partial']:.3f} [{low:.3f}, {high:.3f}]; unrequested objects "
          f"per image {result['extra_objects']:.2f}; diversity of one prompt's images: mean pairwise L1 "
          f"{result['diversity']['pairwise_l1']:.3f}, distinct pairs {result['diversity']['distinct_pair_fraction']:.2f}"
          "  ([a, b]: 95% bootstrap interval over items)")
    print(f"background (pixels darker than 48): mean level {result['background_level']:.2f} of 255, "
          f"{result['background_specks']:.1%} brighter than 12")
    print("what went wrong (fraction of each category's images):")
    print(format_failures(result))
    if baseline is not None:
        from pixelrl.shapes.demo import demo_report

        report = demo_report(baseline, result, baseline["diversity"], result["diversity"])
        print(f"paired against {baseline.get('model', args.baseline)} ({args.baseline}):")
        print("\n".join(report["lines"]))
        if "overall_careful" in baseline:  # a baseline written before the careful judge has none
            print(format_careful(result, baseline=baseline))
        result["paired"] = {"baseline": args.baseline, "strict_gain_interval": report["strict_gain_interval"],
                            "exact_gain_interval": report["exact_gain_interval"]}
    return _write_result(result, args.out)


FOLDER_STEPS, FOLDER_GUIDANCE = 10, 4.0  # a model folder's defaults (the shipped model card's figures)


def sampling_options(args, model, resolution: tuple[int, str] | None = None) -> dict:
    """How `generate` and `eval` sample: --resolution, --steps and --cfg when given; else, for a
    --checkpoint, what its run validated with (rollout.resolution, val_kwargs.num_steps, the
    validation guidance, rollout.negative_prompt); else what the folder's sampler file says, and
    for the rest the model's own size (its pipeline's default), 10 steps and guidance 4.0. A task
    that fixes the size passes `resolution` (the side, and whence it comes). Prints one line saying
    what it uses and whence."""
    from pixelrl.core.errors import ConfigError

    if args.checkpoint:
        from pixelrl.config.sections import from_yaml_text

        run = from_yaml_text((Path(args.checkpoint) / "config.yaml").read_text())
        sampler = run_sampler(run)
        source = "the checkpoint's run validated with"
    else:
        from pixelrl.core.assets import resolve
        from pixelrl.models.export import SAMPLER_FILE, read_sampler

        sampler = read_sampler(resolve(str(getattr(args, "model", None) or "builtin:shapes"))) or {}
        source = f"the folder's {SAMPLER_FILE}" if sampler else "the model folder's defaults"
    if resolution is not None:
        sampler, source = {**sampler, "resolution": resolution[0]}, f"{resolution[1]}' size; the rest {source}"
    given = {"resolution": sampler["resolution"] if "resolution" in sampler else model.default_resolution(),
             "num_steps": sampler.get("num_steps", FOLDER_STEPS),
             "guidance_scale": sampler.get("guidance_scale", FOLDER_GUIDANCE)}
    negative = sampler.get("negative_prompt", "")
    grid = {"sigma_schedule": sampler.get("sigma_schedule", "scheduler"), "sigma_shift": sampler.get("sigma_shift", 0.0)}
    flags = {"resolution": args.resolution, "num_steps": args.steps, "guidance_scale": args.cfg}
    chosen = {key: given[key] if flags[key] is None else flags[key] for key in flags}
    if chosen["resolution"] is None:
        raise ConfigError("--resolution", None, "this model's pipeline has no single default size (a video "
                          "family): pass --resolution")
    from pixelrl.models.loader import check_image_side

    check_image_side(type(model), model.path, chosen["resolution"], "--resolution")
    overridden = [flag for flag, key in (("--resolution", "resolution"), ("--steps", "num_steps"),
                                         ("--cfg", "guidance_scale")) if flags[key] is not None]
    on_grid = "" if grid["sigma_schedule"] == "scheduler" else \
        f" on the {grid['sigma_schedule']} grid" + (f" (shift {grid['sigma_shift']:g})" if grid["sigma_shift"] else "")
    print(f"sampling at {chosen['resolution']} px, {chosen['num_steps']} steps{on_grid}, guidance "
          f"{chosen['guidance_scale']:g} ({source}" + (f"; {', '.join(overridden)} as given" if overridden else "") + ")")
    return {**chosen, "negative_prompt": negative, **grid}


def run_sampler(run, base_folder=None) -> dict:
    """How a run validated: the steps, guidance, negative prompt and grid `generate` and `eval`
    sample its checkpoints with and an export records. With the base folder, for a grid of the run's
    own (`linspace_shift`, a DMD2 student's), also the sigmas a diffusers pipeline takes: its
    scheduler's shift set to 1 so that they are used as they are."""
    import json

    from pixelrl.config.sections import validation_guidance
    from pixelrl.sampling.schedule import linspace_shift_sigmas

    r = run.rollout
    sampler = {"num_steps": run.val_kwargs.num_steps, "guidance_scale": float(validation_guidance(run)),
               "sigma_schedule": r.sigma_schedule, "sigma_shift": float(r.sigma_shift),
               "negative_prompt": r.negative_prompt, "resolution": r.resolution}
    if base_folder is not None and r.sigma_schedule == "linspace_shift":
        scheduler_file = Path(base_folder) / "scheduler" / "scheduler_config.json"
        shift = r.sigma_shift or float(json.loads(scheduler_file.read_text()).get("shift", 1.0))
        sigmas = linspace_shift_sigmas(sampler["num_steps"], shift)[:-1]  # diffusers appends the final 0
        sampler["diffusers"] = {"scheduler": {"shift": 1.0, "use_dynamic_shifting": False},
                                "call": {"sigmas": [round(float(s), 6) for s in sigmas],
                                         "num_inference_steps": sampler["num_steps"],
                                         "guidance_scale": sampler["guidance_scale"]}}
    return sampler


def _check_baseline_sampling(path: str, baseline: dict, sampling: dict) -> None:
    """Paired gains compare like with like: the baseline sampled as this evaluation does."""
    from pixelrl.core.errors import ConfigError

    for key, flag in (("num_steps", "--steps"), ("guidance_scale", "--cfg"), ("resolution", "--resolution")):
        if key in baseline and baseline[key] != sampling[key]:
            raise ConfigError("--baseline", path, f"it was sampled with {key} = {baseline[key]}, this evaluation "
                              f"samples with {sampling[key]}: pass {flag} {baseline[key]}, or evaluate the baseline "
                              "again as this model samples")


SCENES_RESULT_KEYS = ("items", "strict", "overall", "overall_exact", "overall_partial", "extra_objects", "diversity")
EDIT_RESULT_KEYS = ("items", "exact", "followed", "kept", "careful", "pixels_kept")


def _read_baseline(path: str, items: list[dict], needed: tuple[str, ...] = SCENES_RESULT_KEYS,
                   task: str = "scenes") -> dict:
    """A results.json of an earlier `pixelrl eval` of `task` on the same items, for paired intervals."""
    import json

    from pixelrl.core.errors import ConfigError

    if not Path(path).is_file():
        raise ConfigError("--baseline", path, "no such file: pass the results.json an earlier `pixelrl eval --out` "
                          "wrote (runs/eval/results.json by default)")
    try:
        baseline = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("--baseline", path, f"cannot read it as JSON ({err.__class__.__name__}): pass the "
                          "results.json an earlier `pixelrl eval --out` wrote") from None
    if not isinstance(baseline, dict) or any(k not in baseline for k in needed):
        raise ConfigError("--baseline", path, f"not a results.json of `pixelrl eval` ({task} task): it lacks "
                          f"{[k for k in needed if not isinstance(baseline, dict) or k not in baseline]}")
    scored = [(r.get("prompt"), r.get("seed")) for r in baseline["items"] if isinstance(r, dict)]
    if scored != [(it["prompt"], it["seed"]) for it in items]:
        raise ConfigError("--baseline", path, "it was scored on other items: evaluate with the --split, --seed and "
                          "--per-category it was made with")
    return baseline


def _write_result(result: dict, out: str) -> int:
    import json

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _eval_text(args) -> int:
    """`pixelrl eval --task text`: the OCR reward on the text world's items, with 95% intervals."""
    from pixelrl.core.errors import ConfigError
    from pixelrl.shapes import text as shapes_text
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.shapes.evaluate import bootstrap_overall, evaluate_text

    if args.split == "train":
        raise ConfigError("--split", args.split, "val or test for --task text (every word trains; the splits are seeds)")
    model_path = args.model or (None if args.checkpoint else "builtin:shapes_text")
    model = load_for_eval(model_path, args.checkpoint)
    items = shapes_text.evaluation_items(args.split, per_word=args.per_category, seed=args.seed)
    sampling = sampling_options(args, model)
    result = evaluate_text(model, items, progress=True, **sampling)
    result.pop("images")
    name = Path(args.checkpoint).name if args.checkpoint else model_path
    cells = []
    for key in ("ocr", "exact"):
        low, high = bootstrap_overall(result["items"], key)
        cells.append(f"{result[key]:.3f} [{low:.3f}, {high:.3f}]")
    print("| model | ocr | exactly readable |\n|---|---|---|\n" + f"| {name} | " + " | ".join(cells) + " |")
    print(f"{len(items)} images ({len(items) // len(shapes_text.WORDS)} per word, {args.split} split); "
          "[a, b]: 95% bootstrap interval over items")
    result.update(split=args.split, **sampling, model=name)
    return _write_result(result, args.out)


def _eval_edit(args) -> int:
    """`pixelrl eval --task edit`: edit success per kind of edit on the editing world's held-out
    instructions, with 95% intervals."""
    from pixelrl.shapes import edit_world
    from pixelrl.shapes.edit_evaluate import careful_reasons, evaluate_edits, format_edit_table
    from pixelrl.shapes.evaluate import bootstrap_overall
    from pixelrl.trainers.checkpointing import load_for_eval

    from pixelrl.core.errors import ConfigError

    if args.resolution not in (None, edit_world.SIZE):
        raise ConfigError("--resolution", args.resolution, f"the editing world's scenes are {edit_world.SIZE} px and "
                          "an edit has its source's size: leave it out")
    model_path = args.model or (None if args.checkpoint else "builtin:shapes_edit")
    items = edit_world.evaluation_items(args.split, per_edit=args.per_category or 64, seed=args.seed)
    baseline = _read_baseline(args.baseline, items, EDIT_RESULT_KEYS, "edit") if args.baseline else None
    model = load_for_eval(model_path, args.checkpoint)
    # the world's size, not the family's default (FLUX.1 Kontext's pipeline samples 256 px here)
    sampling = sampling_options(args, model, resolution=(edit_world.SIZE, "the editing world's scenes"))
    if baseline is not None:
        _check_baseline_sampling(args.baseline, baseline, sampling)
    result = evaluate_edits(model, items, progress=True, **sampling)
    result.pop("images"), result.pop("sources")
    name = Path(args.checkpoint).name if args.checkpoint else model_path
    for score in ("exact", "followed", "kept", "careful"):
        result[f"{score}_interval"] = bootstrap_overall(result["items"], score)
        print(format_edit_table(result, name, score))
    rejects = ", ".join(f"{reason} {share:.1%}" for reason, share in careful_reasons(result).items())
    print(f"source pixels kept {result['pixels_kept']:.3f}; edits the lenient verdict passes and the careful judge "
          f"rejects: {rejects or 'none'}; {len(items)} edits ({args.split} split), [a, b]: 95% bootstrap interval")
    result.update(split=args.split, **sampling, model=name)
    if baseline is not None:
        from pixelrl.shapes.edit_demo import gain_lines

        print(f"paired against {baseline.get('model', args.baseline)} ({args.baseline}):")
        print("\n".join(gain_lines(baseline, result)))
        result["paired"] = {"baseline": args.baseline,
                            "exact_gain_interval": bootstrap_overall(result["items"], "exact",
                                                                     baseline=baseline["items"])}
    return _write_result(result, args.out)


def cmd_generate(args) -> int:
    from PIL import Image

    from pixelrl.engine.evaluate import generate
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.trainers.tracking import image_grid

    check_output_file(args.out, "--out", image_suffixes())
    for image in args.image or ():
        check_source_image(image)
    model = load_for_eval(args.model, args.checkpoint)
    sampling = sampling_options(args, model)
    sources, size = edit_sources(model, args.image, args.n, sampling["resolution"])
    images = generate(model, [args.prompt] * args.n, list(range(args.seed, args.seed + args.n)), progress=True,
                      condition_images=sources, output_size=size, **sampling)
    grid = image_grid(images.numpy(), ncols=min(8, args.n), scale=4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(args.out)
    print(f"wrote {args.n} images of {args.prompt!r} to {args.out}")
    return 0


def check_source_image(image: str) -> None:
    from pixelrl.core.errors import ConfigError
    from pixelrl.data.prompts import condition_image_problem

    problem = condition_image_problem(Path(image).expanduser())
    if problem:
        raise ConfigError("--image", image, problem)


def edit_sources(model, images: list[str] | None, n: int, resolution: int) -> tuple[list | None, tuple[int, int]]:
    """Each sample's condition images for `generate` (the --image, or several, an edit family
    needs; none for a text-to-image family) and the output's (height, width): square, or for an
    edit about resolution x resolution pixels in its source's aspect (the edit pipelines' rule),
    the sources decoded at that size as training rows are."""
    from pixelrl.core.errors import ConfigError
    from pixelrl.data.prompts import image_size, load_condition_image

    takes, most = model.condition_range()
    images = [str(Path(image).expanduser()) for image in images or ()]
    if takes and not images:
        raise ConfigError("--image", None, f"{type(model).__name__} edits a source image: pass --image PATH")
    if images and not takes:
        raise ConfigError("--image", images[0], f"{type(model).__name__} generates from text alone: drop --image, "
                          "or use an edit model (flux_kontext, qwen_image_edit)")
    if len(images) > most:
        raise ConfigError("--image", images, f"{type(model).__name__} edits from at most {most} source image(s): "
                          f"pass --image at most {most} time(s)")
    if not images:
        return None, (resolution, resolution)
    size = model.edit_output_size(resolution, *image_size(images[model.aspect_source_index]))
    if size != (resolution, resolution):
        print(f"the output follows the source's aspect: {size[1]} x {size[0]} px (width x height)")
    sources = tuple(load_condition_image(image, *size) for image in images)
    return [sources] * n, size


def cmd_make_preferences(args) -> int:
    import torch

    from pixelrl.data.prompts import PromptDataset
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.shapes.preferences import make_preferences
    from pixelrl.workers.group import RewardGroup

    from pixelrl.core.errors import ConfigError

    if (Path(args.out) / "preferences.jsonl").exists():
        raise ConfigError("OUT", args.out, "already holds a preferences.jsonl (and its images), which this would "
                          "overwrite: write to a new folder, or delete that one first")
    check_output_dir(args.out, "OUT")  # before anything samples, not after
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    options = reward_options(args)
    rows = PromptDataset.from_files([args.prompts], field="--prompts").rows
    rewards = RewardGroup([{"name": args.reward, "weight": 1.0, "options": options}], backend="local")
    # the keys the reward returns, from one blank image, so that a --score it lacks stops here
    returned = rewards(torch.zeros(1, args.resolution, args.resolution, 3, dtype=torch.uint8), [rows[0]["prompt"]],
                       [rows[0]["metadata"]])
    if args.score not in returned:
        raise ConfigError("--score", args.score, f"the reward {args.reward} returns {sorted(returned)}: pair by one "
                          "of them")
    summary = make_preferences(load_for_eval(args.model, args.checkpoint), rows, rewards, Path(args.out), n=args.n,
                               seed=args.seed, num_steps=args.steps, guidance_scale=args.cfg,
                               resolution=args.resolution, score_key=args.score, margin=args.margin,
                               max_pairs_per_prompt=args.pairs_per_prompt)
    print(f"{summary['pairs']} pairs from {summary['prompts_with_pairs']} of {summary['prompts']} prompts "
          f"({summary['images']} images); wrote {Path(args.out) / 'preferences.jsonl'}")
    return 0


def cmd_make_demonstrations(args) -> int:
    from pixelrl.core.errors import ConfigError
    from pixelrl.data.prompts import PromptDataset
    from pixelrl.shapes.demonstrations import write_demonstrations, write_edit_demonstrations
    from pixelrl.shapes.edit_world import EDITS
    from pixelrl.shapes.detector import scene_metadata_problem

    if (Path(args.out) / "demonstrations.jsonl").exists():
        raise ConfigError("OUT", args.out, "already holds a demonstrations.jsonl (and its images), which this would "
                          "overwrite: write to a new folder, or delete that one first")
    check_output_dir(args.out, "OUT")
    if args.world == "edit":
        if args.prompts is not None:
            raise ConfigError("--prompts", args.prompts, "the editing world's demonstrations are drawn from its own "
                              "instructions (`--per-edit` of each kind of edit): leave --prompts out with --world edit")
        path = write_edit_demonstrations(Path(args.out), per_edit=args.per_edit, seed=args.seed)
        print(f"{args.per_edit} edits of each of {len(EDITS)} kinds (source and a correct edit); wrote {path}")
        return 0
    rows = PromptDataset.from_files([args.prompts or "builtin:shapes/train_balanced"], field="--prompts").rows
    lacking = next(((row, problem) for row in rows if (problem := scene_metadata_problem(row["metadata"]))), None)
    if lacking is not None:
        raise ConfigError("--prompts", args.prompts, f"the row {lacking[0]['prompt'][:60]!r} has {lacking[1]}: the "
                          "scenes are rendered from each row's metadata (docs/shapes.md, 'Your own prompts')")
    path = write_demonstrations(rows, Path(args.out), per_prompt=args.per_prompt, seed=args.seed)
    print(f"{len(rows) * args.per_prompt} exact scenes of {len(rows)} prompts; wrote {path}")
    return 0


def cmd_pretrain_shapes(args) -> int:
    import torch

    from pixelrl.core.errors import ConfigError
    from pixelrl.shapes.pretrain import WORLDS, parse_category_weights, pretrain_shapes

    check_output_dir(args.out, "OUT")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    arch = None  # the shipped architecture, or with --init the init pipeline's
    if args.text_layers and "text_layers" not in WORLDS[args.world].arch:
        raise ConfigError("--text-layers", args.text_layers, f"the {args.world} world's text encoders have a fixed "
                          "depth (FLUX's CLIP and T5 of the tiny builder); leave it out")
    if args.text_width or args.text_layers:
        arch = dict(WORLDS[args.world].arch)
        arch["text_hidden"] = args.text_width or arch["text_hidden"]
        if args.text_layers:  # refused above for a world whose architecture has no such field
            arch["text_layers"] = args.text_layers
    weights = parse_category_weights(args.category_weights) if args.category_weights else None
    final = pretrain_shapes(args.out, steps=args.steps, seed=args.seed, eval_every=args.eval_every, lr=args.lr,
                            world=args.world, arch=arch, lr_schedule=args.lr_schedule, init=args.init,
                            category_weights=weights, log=lambda line: print(line, flush=True))
    print(f"final EMA pipeline: {final}")
    return 0


def add_parsers(sub) -> None:
    from pixelrl.shapes.demo import DEMO_CONFIG

    demo = sub.add_parser("demo", help="AWM on the shipped shapes model with a before/after evaluation")
    demo.add_argument("--config-name", default=DEMO_CONFIG,
                      help=f"a shapes config (default {DEMO_CONFIG}, AWM; shapes_demo_long: its 40-minute long run; "
                           "shapes_demo_flow_grpo: Flow-GRPO-Fast with the same model and reward; "
                           "shapes_demo_flow_grpo_long: that one's 100-minute long run)")
    demo.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    demo.add_argument("--per-category", type=positive_int, default=64, help="held-out evaluation items per category")
    demo.set_defaults(func=cmd_demo)
    distill = sub.add_parser("demo-distill", help="RL, then distil: on-policy distillation of the demo's policy "
                                                  "into a LoRA student, base / teacher / student scored")
    distill.add_argument("--teacher", default=None,
                         help="the RL-trained teacher, a global_step_N folder of a shapes run (default: the final "
                              "checkpoint of the `pixelrl demo` run here, runs/pixelrl/shapes_demo)")
    distill.add_argument("overrides", nargs="*", help="key=value overrides of configs/shapes_opd.yaml")
    distill.add_argument("--per-category", type=positive_int, default=64, help="held-out evaluation items per category")
    distill.set_defaults(func=cmd_demo_distill)
    edit = sub.add_parser("demo-edit", help="RL on the shipped shapes editing model (FLUX.1 Kontext layout), edit "
                                            "success per kind of edit before/after")
    edit.add_argument("overrides", nargs="*", help="key=value overrides of configs/shapes_edit_demo.yaml")
    edit.add_argument("--per-edit", type=positive_int, default=64, help="held-out evaluation items per kind of edit")
    edit.set_defaults(func=cmd_demo_edit)
    for name, helptext in (("eval", "GenEval-style per-category table on the shapes test set"),
                           ("generate", "write an image grid for a prompt")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", default=None,
                       help="pipeline folder (default: builtin:shapes" + (", with --task text builtin:shapes_text)"
                                                                          if name == "eval" else ")"))
        p.add_argument("--checkpoint", default=None, help="a global_step_N folder of a training run")
        p.add_argument("--resolution", type=positive_int, default=None,
                       help="image side in pixels (default: what the checkpoint's run validated at, else the "
                            "model's own size)")
        p.add_argument("--steps", type=positive_int, default=None,
                       help=f"denoising steps (default: the checkpoint's validation steps, else {FOLDER_STEPS})")
        p.add_argument("--cfg", type=non_negative_float, default=None,
                       help=f"guidance scale (default: the checkpoint's validation guidance, else {FOLDER_GUIDANCE:g})")
        p.add_argument("--seed", type=non_negative_int, default=0, help="the first sampling seed")
        if name == "eval":
            p.add_argument("--split", default="test", choices=["train", "val", "test"], help="which held-out prompts")
            p.add_argument("--per-category", type=positive_int, default=None,
                           help="items per category (per word with --task text, per kind of edit with --task edit); "
                                "default 64 (8 per word)")
            p.add_argument("--task", choices=["scenes", "text", "edit"], default="scenes",
                           help="scenes: GenEval-style tables; text: the OCR reward on the text world (a sign that says "
                                "\"sun\"); edit: edit success per kind of edit (builtin:shapes_edit)")
            p.add_argument("--out", default="runs/eval/results.json", help="the JSON file of scores and items")
            p.add_argument("--baseline", default=None, metavar="RESULTS_JSON",
                           help="an earlier eval's results.json on the same items (e.g. the base model's): print "
                                "the paired gains with 95%% intervals, category changes and diversity against it")
            p.set_defaults(func=cmd_eval)
        else:
            p.add_argument("--prompt", required=True, help="the text prompt (an edit model: the instruction)")
            p.add_argument("--image", action="append", default=None,
                           help="the source image an edit model (flux_kontext, qwen_image_edit) edits, cropped and "
                                "resized to the output; repeat it for several (qwen_image_edit: up to 3)")
            p.add_argument("--n", type=positive_int, default=8, help="images (seeds --seed, --seed + 1, ...)")
            p.add_argument("--out", default="runs/generate/grid.png", help="the image grid to write")
            p.set_defaults(func=cmd_generate)
    pre = sub.add_parser("pretrain-shapes", help="pretrain the shapes model (flow matching on renders); "
                         "run again on the same folder to resume from its last evaluation")
    pre.add_argument("out", help="the folder for the pretrained pipeline and its run.json")
    pre.add_argument("--steps", type=positive_int, default=6000, help="optimizer steps")
    pre.add_argument("--seed", type=non_negative_int, default=0, help="seeds the initial weights and the data")
    pre.add_argument("--eval-every", type=positive_int, default=1500, help="steps between held-out evaluations")
    pre.add_argument("--world", choices=["scenes", "text", "edit"], default="scenes",
                     help='scenes: GenEval-style prompts (builtin:shapes); text: a sign that says "sun", for the ocr '
                          'reward; edit: (source, instruction, target) triples, a FLUX.1 Kontext model (builtin:shapes_edit)')
    pre.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                     help="cosine: decay the learning rate to 0 at --steps (a cosine run cannot be extended)")
    pre.add_argument("--text-width", type=positive_int, default=None,
                     help="width of each of the two CLIP text encoders (default: the first shipped model's, 64)")
    pre.add_argument("--text-layers", type=positive_int, default=None,
                     help="layers of each CLIP text encoder (default: the first shipped model's, 2)")
    pre.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    pre.add_argument("--init", default=None, metavar="PIPELINE",
                     help="start from this pipeline's weights and architecture (a step_N or final folder of a "
                          "pretraining run, or builtin:shapes) instead of random ones")
    pre.add_argument("--category-weights", default=None, metavar="CAT=W,...",
                     help="draw the scenes' categories in proportion to these weights (unlisted: 1), e.g. "
                          "two_object=2,position=2,color_attr=2; default uniform")
    pre.set_defaults(func=cmd_pretrain_shapes)
    prefs = sub.add_parser("make-preferences", help="sample a model, score, and write (chosen, rejected) pairs")
    prefs.add_argument("out", help="folder for preferences.jsonl and images/")
    prefs.add_argument("--model", default=None, help="pipeline folder (default: builtin:shapes)")
    prefs.add_argument("--checkpoint", default=None, help="a global_step_N folder of a training run")
    prefs.add_argument("--prompts", default="builtin:shapes/train_balanced", help="a prompt file (.jsonl/.parquet/.txt)")
    prefs.add_argument("--n", type=positive_int, default=8, help="images per prompt")
    prefs.add_argument("--steps", type=positive_int, default=10, help="sampling steps")
    prefs.add_argument("--cfg", type=non_negative_float, default=1.0, help="guidance scale")
    prefs.add_argument("--resolution", type=positive_int, default=32, help="image size in pixels")
    prefs.add_argument("--seed", type=non_negative_int, default=0, help="the first sampling seed")
    prefs.add_argument("--reward", default="shapes_geneval", help="the reward that scores the samples")
    prefs.add_argument("--plugin", action="append", help="a module or .py file registering your reward (repeatable)")
    prefs.add_argument("--reward-options", default="{}", help="the reward's options as JSON")
    prefs.add_argument("--score", default="shapes_strict", help="the reward output that ranks images")
    prefs.add_argument("--margin", type=non_negative_float, default=1.0, help="least score difference of a pair")
    prefs.add_argument("--pairs-per-prompt", type=positive_int, default=2, help="the most pairs kept per prompt")
    prefs.set_defaults(func=cmd_make_preferences)
    demos = sub.add_parser("make-demonstrations", help="render each prompt's exact scene, or the editing world's "
                           "exact edits: rows for supervised fine-tuning (algorithm.trainer_type=supervised)")
    demos.add_argument("out", help="folder for demonstrations.jsonl and images/")
    demos.add_argument("--world", choices=["scenes", "edit"], default="scenes", help="scenes: (prompt, target) "
                       "rows; edit: (instruction, source, target) rows of the editing world's train instructions")
    demos.add_argument("--prompts", default=None, help="scenes: a prompt file whose rows carry scene metadata "
                       "(default builtin:shapes/train_balanced)")
    demos.add_argument("--per-prompt", type=positive_int, default=4, help="scenes: layouts (seeds) rendered per prompt")
    demos.add_argument("--per-edit", type=positive_int, default=128, help="edit: items of each kind of edit")
    demos.add_argument("--seed", type=non_negative_int, default=0, help="the first layout seed")
    demos.set_defaults(func=cmd_make_demonstrations)
