"""Vision-language models: `pretrain-vlm`, `demo-vlm`, `eval-vlm`."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

from pixelrl.cli.arguments import non_negative_int, positive_int


def cmd_pretrain_vlm(args) -> int:
    import torch

    from pixelrl.core.paths import check_output_dir
    from pixelrl.shapes.qa_model import pretrain_shapes_qa

    check_output_dir(args.out, "OUT")
    torch.set_num_threads(args.threads)
    final = pretrain_shapes_qa(args.out, steps=args.steps, seed=args.seed, eval_every=args.eval_every,
                               log=lambda line: print(line, flush=True))
    print(f"final model folder: {final}")
    return 0


def demo_console(line: str, stream=None) -> None:
    """The trainer's lines as the demo shows them: a step's line cut to its reward and progress
    (`step 3: rewards/mean=0.41  [3/40, 12s, eta 2m05s]`; the tracker prints critic/rewards/mean
    without its section), anything else whole."""
    import re

    if line.startswith("step ") and line.endswith("]"):
        reward = re.search(r"(?<!\S)rewards/mean=\S+", line)
        line = f"{line.split(':', 1)[0]}: {reward.group(0) + '  ' if reward else ''}{line[line.rfind('['):]}"
    print(line, file=stream or sys.stdout, flush=True)


def cmd_demo_vlm(args) -> int:
    """configs/vlm_grpo_shapes_qa.yaml: held-out accuracy per question type before and after."""
    import torch

    from pixelrl.config import load_config
    from pixelrl.shapes.qa import QUESTION_TYPES, colour_only_accuracy
    from pixelrl.vlm.pretrain import summarise_correctness
    from pixelrl.vlm.qa_tasks import task_items
    from pixelrl.vlm.trainer import VLMPPOTrainer

    from pixelrl.trainers.report import write_report
    from pixelrl.trainers.run_folder import run_dir_of

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    fixed = ["trainer.resume_mode=disable", "trainer.val_before_train=true"]  # before and after: always from scratch
    cfg = load_config("vlm_grpo_shapes_qa", [*fixed, *args.overrides])
    if not any(o.startswith("trainer.experiment_name=") for o in args.overrides):
        # an earlier demo's run stays as it is: this one goes to the next free folder beside it
        name, earlier = cfg.trainer.experiment_name, run_dir_of(cfg)
        for n in itertools.count(2):
            if not any((run_dir_of(cfg) / "checkpoints").glob("global_step_*")):
                break
            cfg = load_config("vlm_grpo_shapes_qa", [*fixed, *args.overrides, f"trainer.experiment_name={name}_{n}"])
        if run_dir_of(cfg) != earlier:
            print(f"an earlier demo-vlm run is in {earlier}: this one writes {run_dir_of(cfg)}")
    task = "the shipped shapes-QA Qwen2-VL" if cfg.vlm.task == "shapes_qa" else f"{cfg.model.path} with question files"
    print(f"pixelrl demo-vlm: GRPO on {task}, {cfg.data.train_batch_size} questions x "
          f"{cfg.rollout.n} answers per step, {cfg.trainer.total_training_steps} steps; held-out accuracy on "
          f"{cfg.vlm.val_items} test questions (greedy)")
    start = time.time()
    result = VLMPPOTrainer(cfg, console=demo_console).fit()
    before, after = result["val"][0], result["val"][-1]
    minutes = (time.time() - start) / 60
    # balanced accuracy: a policy that gives one answer to every question of a type scores 1/K there;
    # colour only: what seeing colours but not shapes scores on the same questions
    # (shapes-QA only: a question file's items carry no scene to reason about)
    reference = summarise_correctness([(it["type"], it["answer"], colour_only_accuracy(it))
                                       for it in task_items(cfg, "test", 0, cfg.vlm.val_items)], QUESTION_TYPES) \
        if cfg.vlm.task == "shapes_qa" else {}
    print(f"{'question type':<14}{'accuracy':>17}{'balanced accuracy':>22}{'colour only':>14}")
    print(f"{'':<14}{'before':>8}{'after':>9}{'before':>13}{'after':>9}")
    types = sorted(k[len("val/accuracy_"):] for k in before if k.startswith("val/accuracy_"))
    table = ["| question type | accuracy before | after | balanced before | after | colour only |",
             "|---|---|---|---|---|---|"]
    for name, plain, balanced in [(t, f"val/accuracy_{t}", f"val/balanced_accuracy_{t}") for t in types] + \
            [("overall", "val/accuracy", "val/balanced_accuracy")]:
        colour = f"{reference[plain.removeprefix('val/')]:.3f}" if reference else "-"
        print(f"{name:<14}{before[plain]:>8.3f}{after[plain]:>9.3f}{before[balanced]:>13.3f}{after[balanced]:>9.3f}"
              f"{colour:>14}")
        table.append(f"| {name} | {before[plain]:.3f} | {after[plain]:.3f} | {before[balanced]:.3f} | "
                     f"{after[balanced]:.3f} | {colour} |")
    gain = (f"gain: {after['val/accuracy'] - before['val/accuracy']:+.3f} accuracy, "
            f"{after['val/balanced_accuracy'] - before['val/balanced_accuracy']:+.3f} balanced accuracy in "
            f"{minutes:.1f} min")
    run_dir = Path(result["run_dir"])
    (run_dir / "demo_summary.json").write_text(json.dumps({
        "lines": [f"held-out accuracy on {cfg.vlm.val_items} test questions (greedy), before and after "
                  f"{cfg.trainer.total_training_steps} GRPO steps", *table, gain],
        "before": before, "after": after, "minutes": minutes}, indent=1))
    print(f"{gain}; run folder {run_dir}")
    print(f"wrote {run_dir / 'demo_summary.json'}, {write_report(run_dir)}")
    return 0


def cmd_eval_vlm(args) -> int:
    """Greedy held-out accuracy of a Qwen2-VL folder, per question type: on question files
    (`vlm.task: files` rows) or on the shapes-QA test questions."""

    import torch

    from pixelrl.core.assets import resolve
    from pixelrl.core.errors import ConfigError
    from pixelrl.core.paths import check_output_file
    from pixelrl.shapes import qa as shapes_qa
    from pixelrl.vlm import qa_files
    from pixelrl.vlm.pretrain import answer_correctness, summarise_correctness
    from pixelrl.models.qwen_vl import QwenVLModel

    if args.out:
        check_output_file(args.out, "--out", (".json",))
    folder = Path(resolve(args.model, "--model"))
    if not (folder / "config.json").is_file():
        raise ConfigError("--model", args.model, "no config.json there: give a Qwen2-VL folder (e.g. one written "
                          "by `pixelrl export` from a vision-language checkpoint)")
    if args.files:
        rows = qa_files.open_qa_files(tuple(args.files), args.question_key, "--files")
        rows = rows[:args.items] if args.items else rows
        items = [qa_files.load_item(row) for row in rows]
    else:
        items = shapes_qa.items("test", 0, args.items or 300)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = QwenVLModel(folder)
    results = answer_correctness(model, items, max_new_tokens=args.max_new_tokens, extract=args.extract)
    summary = summarise_correctness(results, () if args.files else shapes_qa.QUESTION_TYPES)
    print(f"{len(items)} questions, greedy, {args.model}")
    print(f"{'question type':<16}{'questions':>10}{'accuracy':>10}{'balanced':>10}")
    for kind in sorted({kind for kind, *_ in results}):
        print(f"{kind:<16}{sum(1 for k, *_ in results if k == kind):>10}{summary['accuracy_' + kind]:>10.3f}"
              f"{summary['balanced_accuracy_' + kind]:>10.3f}")
    print(f"{'overall':<16}{len(results):>10}{summary['accuracy']:>10.3f}{summary['balanced_accuracy']:>10.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "questions": len(items), **summary}, indent=1))
        print(f"wrote {args.out}")
    return 0


def add_parsers(sub) -> None:
    from pixelrl.vlm.answers import EXTRACTORS

    pre_vlm = sub.add_parser("pretrain-vlm", help="pretrain the shapes-QA vision-language model (supervised)")
    pre_vlm.add_argument("out", help="the folder for the pretrained Qwen2-VL-layout model")
    pre_vlm.add_argument("--steps", type=positive_int, default=125, help="optimizer steps")
    pre_vlm.add_argument("--seed", type=non_negative_int, default=0, help="seeds the weights and the data")
    pre_vlm.add_argument("--eval-every", type=positive_int, default=25, help="steps between held-out evaluations")
    pre_vlm.add_argument("--threads", type=positive_int, default=1, help="torch threads (1 reproduces the shipped model)")
    pre_vlm.set_defaults(func=cmd_pretrain_vlm)
    demo_vlm = sub.add_parser("demo-vlm", help="GRPO on the shipped shapes-QA VLM with accuracy before/after")
    demo_vlm.add_argument("overrides", nargs="*", help="key=value overrides of configs/vlm_grpo_shapes_qa.yaml")
    demo_vlm.set_defaults(func=cmd_demo_vlm)
    eval_vlm = sub.add_parser("eval-vlm", help="held-out accuracy of a Qwen2-VL folder per question type")
    eval_vlm.add_argument("--model", default="builtin:shapes_qa_vlm", help="a Qwen2-VL folder")
    eval_vlm.add_argument("--files", nargs="*", default=[], help="question files (.jsonl / .parquet, the rows of "
                          "vlm.task=files); default: the shapes-QA test questions")
    eval_vlm.add_argument("--items", type=non_negative_int, default=0,
                          help="the first N questions (0: every row of --files, 300 shapes-QA questions)")
    eval_vlm.add_argument("--question-key", default="question", help="the files' question column")
    eval_vlm.add_argument("--max-new-tokens", type=positive_int, default=4, help="the longest answer generated")
    eval_vlm.add_argument("--extract", choices=EXTRACTORS, default="whole",
                          help="where the answer is in a response (as answer_match's extract option)")
    eval_vlm.add_argument("--out", default=None, help="also write the scores to this .json file")
    eval_vlm.set_defaults(func=cmd_eval_vlm)
