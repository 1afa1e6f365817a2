"""The vision-language trainer's items: a generated task (`vlm.task`, e.g. the shapes world's
`shapes_qa`) or (image, question, answer) rows from files (`vlm.task: files`), each a pure
function of its index so every rank draws its own share alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.registry import Registry

# RL draws a generated task's train items far from the ones supervised pretraining saw (from 0).
RL_ITEM_OFFSET = 10**8


@dataclass(frozen=True)
class QATask:
    """A generated question source: `items(split, start, count)` -> dicts with image, question,
    answer and type; `question_types` orders the per-type accuracies."""
    items: Callable[[str, int, int], list[dict]]
    question_types: tuple[str, ...] = ()


QA_TASKS: Registry = Registry("question task", "vlm.task")
QA_TASKS.register("files")(QATask(items=None))  # rows from data.train_files / val_files


def question_types(cfg: PixelRLConfig) -> tuple[str, ...]:
    return QA_TASKS.get(cfg.vlm.task).question_types


def task_items(cfg: PixelRLConfig, split: str, start: int, count: int) -> list[dict]:
    """Items `start .. start + count - 1` of `split` ("train", or "test" for validation)."""
    if cfg.vlm.task == "files":
        from pixelrl.vlm import qa_files

        rows = task_rows(cfg, split)
        if split == "train":
            return qa_files.train_items(rows, start, count, cfg.data.seed, cfg.data.shuffle)
        return [qa_files.load_item(row) for row in rows[start:start + count]]
    offset = RL_ITEM_OFFSET + cfg.data.seed * 10**7 if split == "train" else 0
    return QA_TASKS.get(cfg.vlm.task).items(split, offset + start, count)


def task_rows(cfg: PixelRLConfig, split: str) -> tuple[dict, ...]:
    """The checked rows of `vlm.task: files` for `split` (train: data.train_files, else data.val_files)."""
    from pixelrl.vlm import qa_files

    field = "data.train_files" if split == "train" else "data.val_files"
    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    return qa_files.open_qa_files(tuple(str(f) for f in files), cfg.data.prompt_key, field)


def check_task_data(cfg: PixelRLConfig) -> None:
    """Open the dataset files on the driver, so a bad row or too few held-out rows stops the run
    before any worker starts."""
    from pixelrl.core.errors import ConfigError
    from pixelrl.vlm import qa_files

    if cfg.vlm.ptx_files:  # the supervised set of vlm.ptx_coef: every row checked now
        qa_files.open_ptx_files(tuple(str(f) for f in cfg.vlm.ptx_files), cfg.data.prompt_key)
    if cfg.vlm.task != "files":
        return
    task_rows(cfg, "train")
    t = cfg.trainer
    if t.val_before_train or t.test_freq != -1:
        held_out = len(task_rows(cfg, "test"))
        if cfg.vlm.val_items > held_out:
            raise ConfigError("vlm.val_items", cfg.vlm.val_items, f"data.val_files hold {held_out} rows: use at most "
                              f"that many (a multiple of trainer.n_workers={t.n_workers})")
