"""`pixelrl report RUN`: one self-contained HTML page of a run folder, readable offline.

It holds the curves of the run's main metrics (matplotlib figures with axes, a smoothed line and
the values that are not finite marked, inlined as PNG data URIs; no script), the validation
metrics by step, a demo's held-out tables as HTML tables, the sample grids by step, where the
time went, and the resolved config. Everything is read from the files the run wrote
(metrics.jsonl, read as `pixelrl plot` reads it; samples/, config.yaml, demo_summary.json); nothing is unpickled and
nothing named by the files is executed. Text from the files is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from pixelrl.algos.methods import training_metric_keys
from pixelrl.engine.image_stats import WATCHABLE
from pixelrl.trainers.curves import split_points
from pixelrl.trainers.hacking import hacking_lines
from pixelrl.trainers.tracking import read_metric_rows

# curves drawn when the run logged them, in this order (a pattern ends with * for a prefix)
# after the methods' own training metrics (`MethodSpec.training_metrics`)
CURVES = ("actor/pg_loss", "actor/kl", "actor/grad_norm", "val-core/*",
          *(f"val-aux/image/{name}" for name in WATCHABLE), "timing_s/step")
MAX_GRIDS = 12  # the last ones by step: a long run's page stays small
FIGURES = ("before_after.png", "base_teacher_student.png", "source_base_trained.png", "reward_curve.png",
           "validation_curve.png")


def curve_keys(rows: list[dict]) -> list[str]:
    present = sorted({k for row in rows for k in row})
    keys = []
    for pattern in (*training_metric_keys(), *CURVES):
        if pattern.endswith("*"):
            keys += [k for k in present if k.startswith(pattern[:-1]) and k not in keys]
        elif pattern in present:
            keys.append(pattern)
    return keys


def curve_figure(rows: list[dict], key: str) -> str:
    """One metric against the step as a figure: axes with ticks and units, the raw values and a
    smoothed line, values that are not finite marked and named in the caption (`curves`)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pixelrl.trainers.curves import draw_metric, not_finite_note

    fig, ax = plt.subplots(figsize=(4.6, 2.6))
    xs, ys, bad = draw_metric(ax, rows, key)
    if not xs and not bad:
        plt.close(fig)
        return ""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    name = html.escape(key)
    values = f"{ys[0]:.4g} at step {xs[0]:g}, {ys[-1]:.4g} at step {xs[-1]:g}" if xs else "no finite value"
    warning = f' <strong class="bad">{html.escape(not_finite_note(bad))}</strong>' if bad else ""
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (f'<figure class="curve"><img class="plot" alt="{name}" src="data:image/png;base64,{data}">'
            f'<figcaption>{name}: {values}{warning}</figcaption></figure>')


def inline_png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    return f"{value:.4f}" if math.isfinite(value) else f'<span class="bad">{value}</span>'


def validation_table(rows: list[dict]) -> str:
    """The validation metrics by step (`val-core/*` of the diffusion trainers, `val/*` of the
    vision-language one), each column headed by its name, the images' count where logged."""
    validations = [r for r in rows if any(k.startswith(("val-core/", "val/")) for k in r)]
    if not validations:
        return ""
    keys = sorted({k for r in validations for k in r if k.startswith(("val-core/", "val/"))
                   and isinstance(r[k], (int, float)) and not isinstance(r[k], bool)})
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(f"<tr><td>{r['step']:g}</td>" + "".join(f"<td>{_number(r.get(k))}</td>" for k in keys) + "</tr>"
                   for r in validations)
    return f'<div class="wide"><table class="validation"><tr><th>step</th>{head}</tr>{body}</table></div>'


def no_validation_hint(config: dict) -> str:
    """Why a run logged no validation, from its config: no prompts to validate on, or none due."""
    data, trainer = config.get("data") or {}, config.get("trainer") or {}
    if data.get("val_files") or data.get("val_prompts"):
        return (f"<p>No validation was run: data.val_files is set but trainer.test_freq is "
                f"{html.escape(str(trainer.get('test_freq')))}; set it to validate every N steps.</p>")
    return "<p>No validation was run (set data.val_files and trainer.test_freq to validate every N steps).</p>"


def timing_table(rows: list[dict]) -> str:
    keys = sorted({k for row in rows for k in row if k.startswith("timing_s/")})
    if not keys:
        return "<p>No timings logged.</p>"
    cells = []
    for key in keys:
        _, finite, bad = split_points(rows, key)
        mean = f"{sum(finite) / len(finite):.3f}" if finite else ""
        note = f' <span class="bad">({len(bad)} not finite, left out)</span>' if bad else ""
        cells.append(f"<tr><td>{html.escape(key[9:])}</td><td>{mean}</td><td>{sum(finite):.1f}{note}</td></tr>")
    return ("<table class=\"timing\"><tr><th>phase</th><th>mean s per step</th><th>total s</th></tr>"
            + "".join(cells) + "</table>")


def _table_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def lines_as_html(lines: list[str]) -> str:
    """Printed lines as HTML: each markdown table (`| a | b |` lines, the `|---|` rule under its
    header; a rule after rows starts the next table) as a table, every other line as a
    paragraph; all text escaped."""
    out, table = [], []

    def flush():
        if table:
            rows = [r for r in table if not all(set(c) <= set("-: ") for c in r)]
            head, body = rows[0], rows[1:]
            out.append('<div class="wide"><table class="heldout"><tr>' + "".join(f"<th>{html.escape(c)}</th>" for c in head)
                       + "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                                           for r in body) + "</table></div>")
            table.clear()

    for line in (str(line) for line in lines):
        if line.strip().startswith("|"):
            row = _table_row(line)
            if all(set(c) <= set("-: ") for c in row) and len(table) > 1:  # a rule: the row above heads a new table
                header = table.pop()
                flush()
                table.append(header)
            table.append(row)
            continue
        flush()
        if line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "".join(out)


def demo_lines(run: Path) -> list[str]:
    """The held-out lines a demo wrote (demo_summary.json's `lines`), as they were printed."""
    path = run / "demo_summary.json"
    if not path.is_file():
        return []
    try:
        lines = json.loads(path.read_text()).get("lines", [])
    except (ValueError, AttributeError):
        return []
    return lines if isinstance(lines, list) else []


def _config(run: Path) -> tuple[str, dict]:
    """The run's config.yaml as text and as plain data (nothing resolved or executed)."""
    from omegaconf import OmegaConf

    path = run / "config.yaml"
    if not path.is_file():
        return "(no config.yaml)", {}
    text = path.read_text()
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception:  # a damaged config still gets its page, without the hint it would give
        data = None
    return text, data if isinstance(data, dict) else {}


def write_report(run: str | Path, out: str | Path | None = None) -> Path:
    """Write `<run>/report.html` (or `out`) and return its path."""
    run = Path(run)
    rows = read_metric_rows(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    grids = sorted((run / "samples").glob("*.png"))[-MAX_GRIDS:] if (run / "samples").is_dir() else []
    # the pictures a demo wrote beside the run (before / after on the same prompts and seeds, curves)
    grids = [p for p in (run / name for name in FIGURES) if p.is_file()] + grids
    config_text, config = _config(run)
    last = rows[-1]["step"] if rows else 0
    curves = "".join(curve_figure(rows, key) for key in curve_keys(rows)) or "<p>No metrics logged yet.</p>"
    pictures = "".join(f"<figure class=\"grid\">{inline_png(p)}<figcaption>{html.escape(p.stem)}</figcaption>"
                       "</figure>" for p in grids) or "<p>No sample grids (set trainer.log_image_grid_every).</p>"
    validation, held_out = validation_table(rows), lines_as_html(demo_lines(run))
    if watch := lines_as_html(hacking_lines(rows, config)):  # what the rules of trainers/hacking.py say
        validation = f'<div id="hacking">{watch}</div>{validation}'
    if held_out:  # a demo's own held-out evaluation is the validation a user reads first
        validation = (f"<h3>Held-out evaluation (the demo's, after training)</h3>{held_out}"
                      + (f"<h3>During training</h3>{validation}" if validation else ""))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>pixelrl run {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1400px;line-height:1.4}}
figure{{display:inline-block;margin:.5em;vertical-align:top;max-width:100%}}
figcaption{{font-size:14px;max-width:460px;overflow-wrap:break-word}}
img.plot{{width:460px;max-width:100%;height:auto}}
figure.grid img{{image-rendering:pixelated;width:720px;max-width:100%;height:auto}}
figure.grid figcaption{{max-width:720px}}
.wide{{overflow-x:auto;max-width:100%}} table{{border-collapse:collapse;font-size:14px;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} th{{background:#f3f3f3}}
td:first-child,th:first-child{{text-align:left}} .bad{{color:#b00}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style>
</head><body>
<h1>pixelrl run <code>{html.escape(run.name)}</code></h1>
<p id="summary">{len(rows)} logged rows, last step {last:g}; folder <code>{html.escape(str(run.resolve()))}</code></p>
<h2>Curves</h2><div id="curves">{curves}</div>
<h2>Validation</h2><div id="validation">{validation or no_validation_hint(config)}</div>
<h2>Sample grids</h2><div id="grids">{pictures}</div>
<h2>Where the time went</h2>{timing_table(rows)}
<h2>Config</h2><pre id="config">{html.escape(config_text)}</pre>
</body></html>
"""
    target = Path(out) if out else run / "report.html"
    target.write_text(page)
    return target
