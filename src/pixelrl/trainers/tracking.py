"""Experiment tracking: console, JSONL, TensorBoard (scalars and image grids), wandb (offline
works), and PNG sample grids with prompts and scores."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pixelrl.algos.methods import trained_role_prefixes, training_metric_keys
from pixelrl.core.errors import ConfigError
from pixelrl.core.progress import Progress

# shown on the console line after the methods' own training metrics (`MethodSpec.training_metrics`)
CONSOLE_KEYS = ("actor/pg_loss", "actor/kl", "actor/clipfrac", "actor/grad_norm", "critic/explained_variance",
                "perf/throughput", "perf/mfu", "timing_s/step")


CAPTION_PX = (12, 11, 10, 9, 8)  # the caption font sizes tried, largest first


def caption_font(captions: list[str], width: float):
    """The largest caption font in which every word of `captions` fits `width` pixels."""
    words = {word for caption in captions for word in caption.split()}
    for size in CAPTION_PX:
        font = ImageFont.load_default(size=size)
        if all(font.getlength(word) <= width for word in words):
            return font
    return font


def wrap_to_width(text: str, font, width: float) -> list[str]:
    """`text` in lines no wider than `width` pixels in `font`, broken between words (inside a word
    only where the word alone is wider)."""
    lines: list[str] = []
    for word in text.split():
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
            continue
        while font.getlength(word) > width and len(word) > 1:  # longer than a line: cut where it fills one
            cut = max([i for i in range(1, len(word)) if font.getlength(word[:i]) <= width] or [1])
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines


def image_grid(images: np.ndarray, captions: list[str] | None = None, ncols: int = 8, scale: int = 2) -> np.ndarray:
    """Tile uint8 images [B, H, W, 3] into one image, each with an optional caption beneath; videos
    [B, T, H, W, 3] are shown by their middle frame."""
    if images.ndim == 5:
        images = images[:, images.shape[1] // 2]
    count, h, w, _ = images.shape
    ncols = min(ncols, count)
    nrows = math.ceil(count / ncols)
    cell_w = w * scale
    # every caption whole, in a scalable font (the bitmap default is ~8 px high): 12 px, or the
    # largest down to 8 px in which every word fits the cell, broken between words to the cell's
    # width (a word wider than a line even at 8 px is broken inside it); the caption band is as
    # tall as the longest needs
    font = caption_font(captions or [], cell_w - 4)
    wrapped = [wrap_to_width(c, font, cell_w - 4) for c in captions] if captions else []
    size = font.size
    line_h = size + 3
    text_h = line_h * max(map(len, wrapped), default=0) + 4 if captions else 0
    canvas = Image.new("RGB", (ncols * cell_w, nrows * (h * scale + text_h)), (255, 255, 255))
    pen = ImageDraw.Draw(canvas)
    for i in range(count):
        row, col = divmod(i, ncols)
        x, y = col * cell_w, row * (h * scale + text_h)
        canvas.paste(Image.fromarray(images[i]).resize((cell_w, h * scale), Image.NEAREST), (x, y))
        for j, line in enumerate(wrapped[i] if captions else []):
            pen.text((x + 2, y + h * scale + 2 + line_h * j), line, fill=(0, 0, 0), font=font)
    return np.asarray(canvas)


class Tracker:
    def __init__(self, loggers: list[str], run_dir: Path, project: str, experiment: str, config: dict, console=print,
                 resumed_step: int | None = None, total_steps: int | None = None, time_budget_s: float = 0.0):
        """`resumed_step`: the step of the checkpoint this run continues from. A step's row is
        logged before its checkpoint is written, so rows past that step belong to steps that
        will be run again: they are dropped (jsonl) or purged (tensorboard), never doubled.
        `total_steps`: the run's last step; console lines then end with progress and an ETA (within
        `time_budget_s`, when set)."""
        # the console's [i/N, eta]; the ETA ends where trainer.time_budget_s would stop the run first
        self.progress = Progress(total_steps, resumed_step or 0, budget_s=time_budget_s) if total_steps else None
        self.loggers = list(loggers)
        self.run_dir = Path(run_dir)
        self.console = console
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if "jsonl" in self.loggers:
            path = self.run_dir / "metrics.jsonl"
            if resumed_step is not None and path.is_file():
                _keep_rows_up_to(path, resumed_step)
            self._jsonl = path.open("a")
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), 
                                     purge_step=None if resumed_step is None else resumed_step + 1)
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError:
                raise ConfigError("trainer.logger", "wandb", "wandb is not installed: pip install 'pixelrl[wandb]'") from None
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.run_dir),
                                     mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "console" in self.loggers:
            # a trained role's metrics keep their role (DMD2's student/loss and fake_score/loss)
            roles = trained_role_prefixes()
            shown = [f"{k if k.startswith(roles) else k.split('/', 1)[-1]}={clean[k]:.4g}"
                     for k in (*training_metric_keys(), *CONSOLE_KEYS) if k in clean]
            shown += [f"{k}={v:.4g}" for k, v in clean.items() if k.startswith(("val-core/", "val/"))]
            suffix = self.progress.line(step) if self.progress is not None else ""
            self.console(f"step {step}: " + "  ".join(shown) + (f"  [{suffix}]" if suffix else ""))

    def log_images(self, tag: str, grid: np.ndarray, step: int) -> Path:
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{tag.replace('/', '_')}_step{step:06d}.png"
        Image.fromarray(grid).save(path)
        if self._tb is not None:
            self._tb.add_image(tag, grid, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image(grid)}, step=step)
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metric_rows(metrics_file) -> list[dict]:
    """The rows of a metrics.jsonl. A torn last line (the run killed mid-write) is left out, as a
    resumed run drops it; a damaged line before it is an error naming the file and the line."""
    lines = [(n, line) for n, line in enumerate(Path(metrics_file).read_text().splitlines(), 1) if line.strip()]
    rows = []
    for index, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ConfigError("<run>", str(metrics_file), f"line {number} is not a JSON row: the file is damaged "
                              "there; remove that line to read the rest") from None
    return rows


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) without the rows of steps after `step`; the validation row of
    step 0 stays. A torn last line (a kill mid-write) goes too."""
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def x_axis(rows: list[dict], x: str) -> dict[int, float]:
    """Step -> position on the x axis: the step, the minutes of training so far (per-step times
    summed) or the images generated so far (`training/images` summed; in files written before
    that key, throughput x step time, when throughput counted all workers); a row without step
    times (a validation-only row) adds none."""
    elapsed, images, axis = 0.0, 0.0, {}
    for r in rows:
        step_s = r.get("timing_s/step", r.get("timing/step_s", 0.0))  # the VLM trainer's name before 2026-11
        elapsed += step_s
        images += r.get("training/images", r.get("perf/throughput", 0.0) * step_s)
        axis[r["step"]] = {"step": r["step"], "minutes": elapsed / 60, "images": round(images)}[x]
    return axis


def plot_metrics(metrics_file: str | Path, patterns: list[str], out: str | Path, *, x: str = "step") -> list[str]:
    """One panel per metric matching any of `patterns` (shell-style: `val-core/*/gold/*`) from a
    run's metrics.jsonl, against `x`: `step`, `minutes` (the per-step times summed) or `images`
    (images generated for training so far: `training/images` summed). Panels follow the
    patterns' order (the keys one pattern matches, alphabetically); each draws its raw values, a
    smoothed line and its non-finite values marked (`curves.draw_metric`). Returns the plotted
    keys; writes a PNG."""
    import fnmatch

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pixelrl.trainers.curves import draw_metric

    rows = read_metric_rows(metrics_file)
    logged = sorted({k for r in rows for k in r})
    keys = list(dict.fromkeys(k for p in patterns for k in logged if fnmatch.fnmatchcase(k, p)))
    if not keys:
        raise ConfigError("--keys", patterns, f"no metric of {metrics_file} matches; it has e.g. "
                          f"{sorted({k for r in rows for k in r})[:12]}")
    axis = x_axis(rows, x)
    fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2.2 * len(keys)), sharex=True, squeeze=False)
    label = {"step": "step", "minutes": "minutes of training", "images": "images generated"}[x]
    for i, (ax, key) in enumerate(zip(axes[:, 0], keys)):
        draw_metric(ax, rows, key, axis, label if i == len(keys) - 1 else "")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return keys
