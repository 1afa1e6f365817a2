"""argparse types shared by the subcommands."""

from __future__ import annotations

import argparse


def _number(kind, low: float, allow_low: bool):
    """An argparse type: a finite number above `low` (or equal to it when `allow_low`); argparse
    turns the ValueError into one line naming the flag, and exit code 2."""
    import math

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < low or (value == low and not allow_low):
            raise argparse.ArgumentTypeError(f"{text} is not a {'finite ' if kind is float else ''}number "
                                             f"{'>=' if allow_low else '>'} {low:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


positive_int = _number(int, 0, allow_low=False)
non_negative_int = _number(int, 0, allow_low=True)
non_negative_float = _number(float, 0.0, allow_low=True)
positive_float = _number(float, 0.0, allow_low=False)
