"""The reward-hacking watch on two shapes runs, one figure: a normal run and one trained on a
hackable proxy (docs/runtime.md, the reward-hacking watch, has the commands). The flags are
recomputed from each run's rows under the default watch, as `pixelrl report` does.

    python benchmarks/figure_hacking_watch.py NORMAL_RUN HACKED_RUN docs/shapes_hacking_watch.png
"""

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from PIL import Image

from pixelrl.config.sections import HackingWatch
from pixelrl.trainers.hacking import SUSPECTED, hacking_evidence, hacking_metrics

matplotlib.use("Agg")
normal, hacked, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = {"demo's reward (normal)": normal, "JPEG size (hackable)": hacked}


def flagged_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    validations = [r for r in rows if "val-core/overall/reward/mean@4" in r]
    for row in validations:
        row.update(hacking_metrics(hacking_evidence(validations[0], row, 4, HackingWatch(), ["shapes_geneval"])))
    return validations


keys = [("val-core/overall/reward/mean@4", "training reward at validation, change from step 0", True),
        ("val-core/overall/gold/shapes_geneval/mean@4", "gold: shapes_geneval (never trained on)", False),
        ("val-aux/image/colour_entropy", "colour entropy, bits (limit: 0.5 from step 0)", False),
        ("val-core/overall/diversity@4", "diversity@4 (floor: half of step 0's)", False)]
fig = plt.figure(figsize=(14, 6.2))
grid = fig.add_gridspec(3, 4, height_ratios=[1.6, 0.45, 0.45])
for col, (key, title, relative) in enumerate(keys):
    ax = fig.add_subplot(grid[0, col])
    for (name, run), colour in zip(runs.items(), ("tab:blue", "tab:red")):
        vals = [r for r in flagged_rows(run) if key in r]
        base = vals[0][key] if relative else 0.0
        xs, ys = [r["step"] for r in vals], [r[key] - base for r in vals]
        ax.plot(xs, ys, "-o", color=colour, label=name, ms=4)
        flagged = [(r["step"], r[key] - base) for r in vals if r.get(SUSPECTED)]
        if flagged:
            ax.plot(*zip(*flagged), "x", color="black", ms=10, mew=2,
                    label="flagged: hacking suspected" if col == 0 else None)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=.3)
    if col == 0:
        ax.legend(fontsize=8)
for row, (name, run) in enumerate(runs.items(), start=1):
    steps = sorted((run / "validation").glob("step_*"))
    for col, step in enumerate((steps[0], steps[-1])):
        ax = fig.add_subplot(grid[row, col * 2:col * 2 + 2])
        tiles = [Image.open(step / f"{i:05d}.png") for i in range(0, 48, 6)]  # one prompt of each kind
        strip = Image.new("RGB", (sum(t.width for t in tiles) + 2 * len(tiles), tiles[0].height), "white")
        x = 0
        for t in tiles:
            strip.paste(t, (x, 0))
            x += t.width + 2
        ax.imshow(strip, interpolation="nearest")
        ax.axis("off")
        ax.set_title(f"{name}, validation at step {int(step.name[5:])}", fontsize=9)
fig.tight_layout()
fig.savefig(out, dpi=90)
print("wrote", out)
