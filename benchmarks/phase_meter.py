"""Per-phase timing by instrumentation, the same for pixelrl and for a reference implementation.

`PhaseMeter.install()` wraps, at class level, two calls every Flow-GRPO implementation makes:
`torch.autograd.backward` (which `Tensor.backward` and accelerate's `backward` end in) and
`AdamW.step`. `watch(transformer)` times the denoiser's forwards with module hooks, which run
outside its forward and so outside a `torch.compile`d one (a forward with grad is the policy's,
a no-grad one outside sampling is the reference's). Sampling is timed by whoever owns the
sampling call (`meter.phase("sampling")`). Measuring both systems with the same wrappers keeps
their per-phase figures comparable; the wrappers cost a few microseconds a call.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseMeter:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._open: list[str] = []
        self._forwards: list[tuple[str, float] | None] = []

    @contextmanager
    def phase(self, name: str):
        self._open.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            self._open.pop()

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.seconds), dict(self.calls)

    @staticmethod
    def per_iteration(before: tuple[dict, dict], after: tuple[dict, dict], iterations: int) -> dict:
        """Seconds and calls per phase between two snapshots, per iteration."""
        (s0, c0), (s1, c1) = before, after
        return {"seconds": {k: (v - s0.get(k, 0.0)) / iterations for k, v in s1.items()},
                "calls": {k: (v - c0.get(k, 0)) / iterations for k, v in c1.items()}}

    def watch(self, transformer) -> None:
        import torch

        def starts(module, args):
            if "sampling" in self._open:  # inside the sampling phase's time already
                self.calls["sampling_forward"] += 1
                self._forwards.append(None)
            else:
                name = "policy_forward" if torch.is_grad_enabled() else "reference_forward"
                self._forwards.append((name, time.perf_counter()))

        def ends(module, args, output):
            entry = self._forwards.pop()
            if entry is not None:
                self.seconds[entry[0]] += time.perf_counter() - entry[1]
                self.calls[entry[0]] += 1

        transformer.register_forward_pre_hook(starts)
        transformer.register_forward_hook(ends)

    def install(self) -> None:
        import torch

        meter = self

        def timed(name, original):
            def wrapper(*args, **kwargs):
                with meter.phase(name):
                    return original(*args, **kwargs)

            wrapper.__wrapped__ = original
            return wrapper

        torch.autograd.backward = timed("backward", torch.autograd.backward)
        torch.optim.AdamW.step = timed("optimizer", torch.optim.AdamW.step)
