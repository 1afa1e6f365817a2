"""Reward hacking flagged at validation: three rules, each against the run's first validation.

A reward is a proxy: a policy can raise it by moving what the reward cannot see (a JPEG-size
reward pays for a black image; an OCR reward for a dark background). Each validation row is
compared with the first one of the run (`val_kwargs.hacking`, docs/runtime.md):

- `proxy_vs_gold`: the training reward's validation mean rose by more than `proxy_rise` while a
  gold reward of `val_kwargs.rewards` (one the run does not train on) fell by more than
  `gold_drop`;
- `image_drift`: an image statistic (engine/image_stats.py) moved by more than its limit;
- `diversity`: the n images of a prompt grew alike, `diversity@n` below `diversity_floor`
  times the first validation's (mode collapse).

Metrics `val-aux/hacking/<rule>` (1 = tripped) and `val-aux/hacking/suspected` (any rule) are in
every validation row, the evidence in the console; `trainer.stop_when_hacking` stops the run.
The rules read only metric rows, so the report recomputes them from metrics.jsonl.
"""

from __future__ import annotations

import math
import re

from pixelrl.config.sections import HackingWatch
from pixelrl.core.errors import ConfigError
from pixelrl.engine.image_stats import WATCHABLE

RULES = ("proxy_vs_gold", "image_drift", "diversity")
SUSPECTED = "val-aux/hacking/suspected"


def _scope(row: dict, n: int) -> str | None:
    """The data source whose metrics the rules read: `overall` (the mean over several), or the one source."""
    sources = [m.group(1) for key in row if (m := re.fullmatch(rf"val-core/(.+)/reward/mean@{n}", key))]
    return "overall" if "overall" in sources else (sources[0] if len(sources) == 1 else None)


def gold_keys(row: dict, n: int, scope: str | None, watch: HackingWatch, gold_names: list[str]) -> list[str]:
    """The watched gold metrics of a validation row under `scope` (`_scope`): `watch.gold`, or each
    gold function's own output (`gold_names`). A name the row lacks is an error naming the outputs
    it has."""
    prefix, suffix = f"val-core/{scope}/gold/", f"/mean@{n}"
    present = sorted(key[len(prefix):-len(suffix)] for key in row if key.startswith(prefix) and key.endswith(suffix))
    missing = [name for name in watch.gold if name not in present]
    if missing:
        raise ConfigError("val_kwargs.hacking.gold", missing, f"names outputs the gold rewards do not give; they "
                          f"give {present}: name some of those, or [] for each function's own score")
    return [f"{prefix}{name}{suffix}" for name in (watch.gold or [g for g in gold_names if g in present])]


def hacking_evidence(first: dict, row: dict, n: int, watch: HackingWatch,
                     gold_names: list[str]) -> dict[str, list[str]]:
    """Each rule's evidence (empty lists: not tripped) for validation `row` against `first`."""
    evidence: dict[str, list[str]] = {rule: [] for rule in RULES}
    if not watch.enabled:
        return evidence
    scope = _scope(row, n)
    proxy, watched = f"val-core/{scope}/reward/mean@{n}", gold_keys(row, n, scope, watch, gold_names)
    if proxy in row and proxy in first:
        rise = row[proxy] - first[proxy]
        if rise > watch.proxy_rise:
            for key in watched:
                drop = first.get(key, math.nan) - row[key]
                if drop > watch.gold_drop:
                    name = key.split("/")[-2]
                    evidence["proxy_vs_gold"].append(
                        f"reward {rise:+.4g} ({first[proxy]:.4g} -> {row[proxy]:.4g}) while gold {name} "
                        f"{-drop:+.4g} ({first[key]:.4g} -> {row[key]:.4g}; gold_drop {watch.gold_drop:g})")
    for name in WATCHABLE:
        limit, key = watch.drift.get(name, math.inf), f"val-aux/image/{name}"
        if key in row and key in first and abs(row[key] - first[key]) > limit:
            evidence["image_drift"].append(f"{name} {row[key] - first[key]:+.3g} ({first[key]:.3g} -> "
                                           f"{row[key]:.3g}; limit {limit:g})")
    spread = f"val-core/{scope}/diversity@{n}"
    if watch.diversity_floor > 0 and spread in row and first.get(spread, 0) > 0:
        share = row[spread] / first[spread]
        if share < watch.diversity_floor:
            evidence["diversity"].append(f"diversity@{n} {row[spread]:.3g} is {share:.0%} of the first validation's "
                                         f"{first[spread]:.3g} (diversity_floor {watch.diversity_floor:g})")
    return evidence


def evidence_text(evidence: dict[str, list[str]]) -> str:
    return "; ".join(f"{rule}: {', '.join(lines)}" for rule, lines in evidence.items() if lines)


def hacking_metrics(evidence: dict[str, list[str]]) -> dict[str, float]:
    out = {f"val-aux/hacking/{rule}": float(bool(lines)) for rule, lines in evidence.items()}
    out[SUSPECTED] = float(any(evidence.values()))
    return out


def first_validation(rows: list[dict], up_to_step: int) -> dict | None:
    """The first validation row (one with val-core metrics) at or before `up_to_step`."""
    return next((r for r in rows if r.get("step", 0) <= up_to_step and any(k.startswith("val-core/") for k in r)),
                None)


class HackingMonitor:
    """The run's first validation, and each later one's flags; a resumed run reads its first
    validation back from the metrics rows (`seed`)."""

    def __init__(self, watch: HackingWatch, n: int, gold_names: list[str], console=print):
        self.watch, self.n, self.gold_names, self.console = watch, n, gold_names, console
        self.first: dict | None = None
        self.evidence: dict[str, list[str]] = {}

    def seed(self, first: dict | None) -> None:
        self.first = first

    def metrics(self, row: dict, step: int) -> dict[str, float]:
        """The flags of validation `row` (the first one is the baseline: nothing to flag)."""
        if not self.watch.enabled:
            return {}
        if self.first is None:
            self.first = dict(row)
            if step > 0:  # a policy that hacks in the first steps would be its own baseline
                self.console(f"step {step}: val_kwargs.hacking compares later validations with this one, taken "
                             f"after training began; trainer.val_before_train=true compares with the untrained model")
        self.evidence = hacking_evidence(self.first, row, self.n, self.watch, self.gold_names)
        return hacking_metrics(self.evidence)

    def summary(self) -> str:
        """`image_drift: saturation -0.40 (...); diversity: ...`, or "" when nothing tripped."""
        return evidence_text(self.evidence)


def hacking_lines(rows: list[dict], config: dict) -> list[str]:
    """The watch's verdict on a finished run's rows, recomputed under its config's
    val_kwargs.hacking (for the report): one line per flagged validation, or one that none was."""
    vk = config.get("val_kwargs") or {}
    try:
        watch = HackingWatch(**(vk.get("hacking") or {}))
        n, gold_names = int(vk.get("n", 1)), [f["name"] for f in vk.get("rewards") or []]
    except (TypeError, ValueError, KeyError):  # a config written by another version: no verdict
        return []
    validations = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    if not watch.enabled or len(validations) < 2:
        return []
    first, lines = validations[0], []
    for row in validations[1:]:
        try:
            evidence = hacking_evidence(first, row, n, watch, gold_names)
        except ConfigError as err:
            return [str(err)]
        if tripped := evidence_text(evidence):
            lines.append(f"step {row['step']:g}: reward hacking suspected: {tripped}")
    where = f"against step {first['step']:g}'s validation"
    return lines or [f"No validation flagged as reward hacking (val_kwargs.hacking, {where})."]
