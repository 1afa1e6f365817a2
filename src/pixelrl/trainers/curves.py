"""One metric drawn against the step, as `pixelrl plot` and the run report draw it: the raw
values, a smoothed line over them once there are enough points, and every value that is not
finite (NaN, +-Infinity: a diverged step) marked where it happened instead of left out."""

from __future__ import annotations

import math

# TensorBoard's default: each smoothed point is 0.6 of the previous one plus 0.4 of the value
SMOOTHING = 0.6
MIN_POINTS_TO_SMOOTH = 8


def split_points(rows: list[dict], key: str, axis: dict | None = None) -> tuple[list, list, list]:
    """(xs, ys) of the finite values of `key` and the (x, text) of the others, by row; `axis`
    maps a step to its x (the step itself when None)."""
    xs, ys, bad = [], [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        x = axis[row["step"]] if axis is not None else row["step"]
        if math.isfinite(value):
            xs.append(x)
            ys.append(float(value))
        else:
            bad.append((x, "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")))
    return xs, ys, bad


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """An exponential moving average, debiased at the start (the first point is its own mean)."""
    out, mean = [], 0.0
    for i, value in enumerate(values, 1):
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight ** i))
    return out


def unit_of(key: str) -> str:
    return "seconds" if key.startswith("timing_s/") else ""


def not_finite_note(bad: list[tuple]) -> str:
    """`not finite at step 3 (NaN), 4 (-inf)`, the first six, or "" when every value is finite."""
    if not bad:
        return ""
    shown = ", ".join(f"{x:g} ({text})" for x, text in bad[:6])
    return f"not finite at step {shown}" + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")


def draw_metric(ax, rows: list[dict], key: str, axis: dict | None = None, xlabel: str = "step") -> tuple[list, list, list]:
    """Draw `key` on matplotlib axes `ax`: raw points and line, the smoothed line, red crosses at
    the top edge for values that are not finite (labelled), axis labels and a grid."""
    xs, ys, bad = split_points(rows, key, axis)
    smooth = len(xs) >= MIN_POINTS_TO_SMOOTH
    ax.plot(xs, ys, color="#1f77b4", alpha=0.35 if smooth else 1.0, linewidth=1,
            marker="o" if len(xs) < 40 else None, markersize=3, label="logged")
    if smooth:
        ax.plot(xs, smoothed(ys), color="#1f77b4", linewidth=2, label=f"smoothed ({SMOOTHING:g} EMA)")
    if bad:
        top = max(ys) if ys else 1.0
        ax.plot([x for x, _ in bad], [top] * len(bad), linestyle="none", marker="x", color="#d62728", markersize=7,
                markeredgewidth=2, label="not finite")
        ax.set_title(not_finite_note(bad), fontsize=8, color="#d62728", loc="left")
    if smooth or bad:
        ax.legend(fontsize=7, loc="best", frameon=False)
    unit = unit_of(key)
    ax.set_ylabel(key.replace("/", "/\n", 1) + (f"\n({unit})" if unit else ""), fontsize=7)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    if all(float(x).is_integer() for x in xs + [x for x, _ in bad]):  # steps and image counts: whole ticks
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return xs, ys, bad
