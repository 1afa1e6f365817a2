"""Per-phase timing by instrumentation, the same for pixelrl and for a reference implementation.

`PhaseMeter.install()` wraps, at class level, the calls every Flow-GRPO implementation on SD3
makes: the transformer's forward (counted and timed; a forward with grad is the policy's, a
no-grad one outside sampling is the reference's), `torch.autograd.backward` (which
`Tensor.backward` and accelerate's `backward` end in) and `AdamW.step`. Sampling is timed by
whoever owns the sampling call (`meter.phase("sampling")`). Measuring both systems with the same
wrappers keeps their per-phase figures comparable; the wrappers cost a few microseconds a call.
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

    def install(self) -> None:
        import torch
        from diffusers import SD3Transformer2DModel

        meter = self

        def timed(name_of, original):
            def wrapper(*args, **kwargs):
                name = name_of()
                if name is None:  # nested inside a phase that already counts this time
                    return original(*args, **kwargs)
                with meter.phase(name):
                    return original(*args, **kwargs)

            wrapper.__wrapped__ = original
            return wrapper

        def forward_kind():
            if "sampling" in meter._open:
                meter.calls["sampling_forward"] += 1
                return None
            return "policy_forward" if torch.is_grad_enabled() else "reference_forward"

        SD3Transformer2DModel.forward = timed(forward_kind, SD3Transformer2DModel.forward)
        torch.autograd.backward = timed(lambda: "backward", torch.autograd.backward)
        torch.optim.AdamW.step = timed(lambda: "optimizer", torch.optim.AdamW.step)
