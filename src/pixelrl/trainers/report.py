"""`pixelrl report RUN`: one self-contained HTML page of a run folder, readable offline.

It holds the curves of the run's main metrics (inline SVG, no script), the sample grids by step
(PNG inlined as data URIs), the validation scores by step, the held-out tables a demo wrote, where
the time went, and the resolved config. Everything is read from the files the run wrote
(metrics.jsonl, read as `pixelrl plot` reads it; samples/, validation/, config.yaml,
demo_summary.json); nothing is unpickled and
nothing named by the files is executed. Text from the files is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from pixelrl.engine.image_stats import STATISTICS
from pixelrl.trainers.tracking import read_metric_rows

# curves drawn when the run logged them, in this order (a pattern ends with * for a prefix)
CURVES = ("critic/rewards/mean", "student/loss", "fake_score/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm",
          "val-core/*", *(f"val-aux/image/{name}" for name in STATISTICS), "timing_s/step")
MAX_GRIDS = 12  # the last ones by step: a long run's page stays small
FIGURES = ("before_after.png", "base_teacher_student.png", "source_base_trained.png", "reward_curve.png",
           "validation_curve.png")


def curve_keys(rows: list[dict]) -> list[str]:
    present = sorted({k for row in rows for k in row})
    keys = []
    for pattern in CURVES:
        if pattern.endswith("*"):
            keys += [k for k in present if k.startswith(pattern[:-1]) and k not in keys]
        elif pattern in present:
            keys.append(pattern)
    return keys


def svg_curve(rows: list[dict], key: str, width: int = 420, height: int = 180) -> str:
    """One metric against the step as an inline SVG line with its axis ranges written out."""
    points = [(float(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))
              and math.isfinite(float(r[key]))]
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    pad = 30

    def at(x, y):
        return (pad + (x - x0) / (x1 - x0) * (width - 2 * pad), height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad))

    path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in points))
    marks = "".join(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2"/>' for px, py in (at(x, y) for x, y in points)) \
        if len(points) <= 60 else ""
    name = html.escape(key)
    return (f'<figure class="curve"><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="{name}"><rect width="100%" height="100%" fill="#fff" stroke="#ccc"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/><g fill="#1f77b4">{marks}</g>'
            f'<text x="{pad}" y="14" font-size="11">{y1:.4g}</text>'
            f'<text x="{pad}" y="{height - 8}" font-size="11">{y0:.4g} (step {x0:g} .. {x1:g})</text></svg>'
            f'<figcaption>{name}: {ys[0]:.4g} at step {xs[0]:g}, {ys[-1]:.4g} at step {xs[-1]:g}</figcaption></figure>')


def inline_png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def validation_table(run: Path) -> str:
    """Mean of each score in validation/step_*/samples.jsonl, by step."""
    rows = []
    for folder in sorted((run / "validation").glob("step_*")):
        samples = folder / "samples.jsonl"
        if not samples.is_file():
            continue
        values: dict[str, list[float]] = {}
        for line in samples.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            for key, value in record.items():
                if key not in ("index", "seed") and isinstance(value, (int, float)):
                    values.setdefault(key, []).append(float(value))
        if values:
            rows.append((folder.name, {k: sum(v) / len(v) for k, v in values.items()}, len(next(iter(values.values())))))
    if not rows:
        return "<p>No validation was run (set data.val_files and trainer.test_freq).</p>"
    keys = sorted({k for _, means, _ in rows for k in means})
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(f"<tr><td>{html.escape(name)}</td><td>{n}</td>" + "".join(
        f"<td>{means[k]:.4f}</td>" if k in means else "<td></td>" for k in keys) + "</tr>" for name, means, n in rows)
    return f'<table class="validation"><tr><th>step</th><th>images</th>{head}</tr>{body}</table>'


def timing_table(rows: list[dict]) -> str:
    keys = sorted({k for row in rows for k in row if k.startswith("timing_s/")})
    if not keys:
        return "<p>No timings logged.</p>"
    cells = []
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        cells.append(f"<tr><td>{html.escape(key[9:])}</td><td>{sum(values) / len(values):.3f}</td>"
                     f"<td>{sum(values):.1f}</td></tr>")
    return ("<table class=\"timing\"><tr><th>phase</th><th>mean s per step</th><th>total s</th></tr>"
            + "".join(cells) + "</table>")


def demo_tables(run: Path) -> str:
    """The held-out lines a demo wrote (demo_summary.json's `lines`), as they were printed."""
    path = run / "demo_summary.json"
    if not path.is_file():
        return ""
    try:
        lines = json.loads(path.read_text()).get("lines", [])
    except (ValueError, AttributeError):
        return ""
    text = "\n".join(str(line) for line in lines)
    return f"<h2>Held-out evaluation</h2><pre class=\"heldout\">{html.escape(text)}</pre>" if text else ""


def write_report(run: str | Path, out: str | Path | None = None) -> Path:
    """Write `<run>/report.html` (or `out`) and return its path."""
    run = Path(run)
    rows = read_metric_rows(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    grids = sorted((run / "samples").glob("*.png"))[-MAX_GRIDS:] if (run / "samples").is_dir() else []
    # the pictures a demo wrote beside the run (before / after on the same prompts and seeds, curves)
    grids = [p for p in (run / name for name in FIGURES) if p.is_file()] + grids
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else "(no config.yaml)"
    last = rows[-1]["step"] if rows else 0
    curves = "".join(svg_curve(rows, key) for key in curve_keys(rows)) or "<p>No metrics logged yet.</p>"
    pictures = "".join(f"<figure class=\"grid\">{inline_png(p)}<figcaption>{html.escape(p.stem)}</figcaption>"
                       "</figure>" for p in grids) or "<p>No sample grids (set trainer.log_image_grid_every).</p>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pixelrl run {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} figure{{display:inline-block;margin:.5em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}} img{{image-rendering:pixelated;max-width:640px}}</style>
</head><body>
<h1>pixelrl run <code>{html.escape(run.name)}</code></h1>
<p id="summary">{len(rows)} logged rows, last step {last:g}; folder <code>{html.escape(str(run.resolve()))}</code></p>
<h2>Curves</h2><div id="curves">{curves}</div>
<h2>Sample grids</h2><div id="grids">{pictures}</div>
<h2>Validation</h2>{validation_table(run)}
{demo_tables(run)}
<h2>Where the time went</h2>{timing_table(rows)}
<h2>Config</h2><pre id="config">{html.escape(config)}</pre>
</body></html>
"""
    target = Path(out) if out else run / "report.html"
    target.write_text(page)
    return target
