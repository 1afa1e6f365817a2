"""`pixelrl` command line.

    pixelrl train [--config-name NAME] [key=value ...]   train (Ray, or trainer.backend=local)
    pixelrl plan --config-name NAME --gpus G --gpu-memory GB   fit a recipe's micro-batches to your GPUs
    pixelrl export CHECKPOINT OUT [--adapter-only]      a diffusers pipeline (or adapter) folder; a Qwen2-VL folder
    pixelrl eval [--model PATH | --checkpoint DIR]      GenEval-style table on the shapes test set (--task text: OCR)
    pixelrl generate --prompt "..." [--model PATH]      an image grid (PNG)
    pixelrl pretrain-shapes OUT [--steps N] [--world W]  pretrain a shapes model from scratch (scenes, text, edit)
    pixelrl make-preferences OUT [--prompts FILE]       offline DPO pairs from a model's scored samples
    pixelrl make-demonstrations OUT [--world edit]     exact shapes scenes or edits: rows for supervised fine-tuning
    pixelrl demo [key=value ...]                        AWM on the shipped shapes model, before/after
    pixelrl demo-distill [--teacher DIR]                then distil the demo's policy into a LoRA (on-policy)
    pixelrl demo-edit [key=value ...]                   RL on the shipped shapes editing model, before/after
    pixelrl demo-jpeg                                   15-second Flow-GRPO run on a tiny random model
    pixelrl build-tiny PATH [--family F]                a tiny random SD3 / FLUX (Kontext) / Qwen-Image / Wan pipeline
    pixelrl pretrain-vlm OUT [--steps N]                pretrain the shapes-QA vision-language model
    pixelrl demo-vlm [key=value ...]                    GRPO on the shipped shapes-QA VLM, accuracy before/after
    pixelrl eval-vlm [--model PATH] [--files F ...]     a Qwen2-VL folder's held-out accuracy per question type
    pixelrl plot RUN [--keys PATTERN ...]               a run's metrics as a PNG, one panel per key
    pixelrl report RUN                                  one self-contained HTML page of a run
    pixelrl reproduce NAME|all [--record]               rerun a tiny-model standard, compare with its record
    pixelrl serve-reward --reward NAME [--host H]       a reward behind HTTP for `remote` rewards elsewhere
"""

from __future__ import annotations

import argparse
import sys

from pixelrl.cli import rewards, shapes, training, vlm
from pixelrl.core.quiet import quiet_libraries


def main(argv: list[str] | None = None) -> int:
    from pixelrl.core.plugins import import_extensions

    import_extensions()  # the shapes world's and the VLM trainer's names, before any command looks one up
    parser = argparse.ArgumentParser(prog="pixelrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for commands in (training, shapes, vlm, rewards):
        commands.add_parsers(sub)
    describe_commands(sub)
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
        print("pixelrl: interrupted", file=sys.stderr)  # `train` says what its run folder kept
        return 130


class ShowDefaults(argparse.HelpFormatter):
    """Each option's default after its help, unless it has none (None, False) or the help already
    says what it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def describe_commands(sub) -> None:
    """Every command's --help opens with what it does (its one-line help, unless it has a longer
    description) and shows each option's default."""
    summaries = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():
        command.description = command.description or summaries.get(name)
        command.formatter_class = ShowDefaults


if __name__ == "__main__":
    raise SystemExit(main())
