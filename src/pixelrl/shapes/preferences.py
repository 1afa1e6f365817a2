"""Write an offline preference dataset from a model's own samples (`pixelrl make-preferences`).

Each prompt is sampled `n` times (deterministic sampler, fixed seeds), every image is scored by a
reward, and the best images are paired with the worst ones of the same prompt: the i-th best
with the i-th worst while their scores differ by at least `margin`. With the shapes detector and
`score_key=shapes_strict` (0 or 1) and margin 1, a chosen image passes the strict check and its
rejected partner fails it. The output is the layout `pixelrl.data.preferences` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from pixelrl.engine.evaluate import generate


def preference_pairs(scores: torch.Tensor, margin: float, max_pairs: int) -> list[tuple[int, int]]:
    """(chosen, rejected) indices into one prompt's images: i-th best with i-th worst, no image
    used twice, while score[chosen] - score[rejected] >= margin."""
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    pairs = []
    for i in range(min(max_pairs, len(order) // 2)):
        best, worst = order[i], order[-1 - i]
        if float(scores[best] - scores[worst]) < margin:
            break
        pairs.append((best, worst))
    return pairs


def make_preferences(model, rows: list[dict], reward_fn, out: Path, *, n: int, seed: int, num_steps: int,
                     guidance_scale: float, resolution: int, score_key: str = "overall", margin: float = 0.0,
                     max_pairs_per_prompt: int = 2) -> dict:
    """Sample, score, pair and write `out/preferences.jsonl` plus `out/images/*.png`."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    prompts = [r["prompt"] for r in rows for _ in range(n)]
    metadata = [r["metadata"] for r in rows for _ in range(n)]
    seeds = [seed + i for i in range(len(prompts))]
    images = generate(model, prompts, seeds, num_steps=num_steps, guidance_scale=guidance_scale, resolution=resolution,
                      progress=True)  # a line per batch on stderr: the sampling takes minutes
    scores = reward_fn(images, prompts, metadata)
    if score_key not in scores:
        raise KeyError(f"the reward returned {sorted(scores)}; --score {score_key!r} is not one of them")
    overall, key = scores["overall"], scores[score_key]
    written = 0
    with (out / "preferences.jsonl").open("w") as handle:
        for p, row in enumerate(rows):
            group = range(p * n, (p + 1) * n)
            for chosen, rejected in preference_pairs(key[list(group)], margin, max_pairs_per_prompt):
                names = []
                for local in (chosen, rejected):
                    index = group[local]
                    names.append(f"images/{index:06d}.png")
                    Image.fromarray(images[index].numpy()).save(out / names[-1])
                handle.write(json.dumps({
                    "prompt": row["prompt"], "data_source": row["data_source"], "metadata": row["metadata"],
                    "chosen": names[0], "rejected": names[1],
                    "chosen_score": float(overall[group[chosen]]), "rejected_score": float(overall[group[rejected]]),
                    "chosen_seed": seeds[group[chosen]], "rejected_seed": seeds[group[rejected]]}) + "\n")
                written += 1
    summary = {"prompts": len(rows), "images": len(prompts), "pairs": written,
               "prompts_with_pairs": len({r for r in range(len(rows))
                                          if preference_pairs(key[r * n:(r + 1) * n], margin, 1)}),
               f"mean_{score_key}": float(key.mean())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
