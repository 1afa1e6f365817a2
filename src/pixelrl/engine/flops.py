"""Model FLOPs of the denoiser and the device's matmul peak, for `perf/mfu` on every run.

Forward FLOPs are measured, not estimated: the first forward of each input shape and policy
(the owner's `variant`: a reference forward with LoRA disabled skips the adapter's matmuls) runs
under torch's FLOP counter (matmuls, convolutions and attention) and its count is reused for every
later forward of that shape and policy. With compiled blocks, a forward that builds a graph is
counted by an extra eager forward without one, so that the real forward runs compiled. A forward
that builds a graph is charged three times its FLOPs (forward + backward at twice the forward, the
usual 6·N·D convention, also with LoRA, where the implementation skips most weight gradients), a
no-grad forward once. Sampling, reference and training forwards of the denoiser all count; text
encoding and decoding do not. With gradient checkpointing the recomputed forwards count again
(they are real work).
"""

from __future__ import annotations

import functools
import resource
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

_PEAKS: dict[tuple[str, torch.dtype], float] = {}


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels but not the CPU one that
# scaled_dot_product_attention dispatches to on CPU; without it a CPU run's attention counts as 0
# FLOPs (most of a small model's work: MFU came out at about 40% of the truth on the tiny SD3).
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops}


def _shape_key(args, kwargs) -> tuple:
    tensors = [*args, *kwargs.values()]
    return tuple((tuple(t.shape), t.dtype) for t in tensors if isinstance(t, torch.Tensor))


class FlopMeter:
    """Counts the model FLOPs of every forward of `modules` since the last `take()`. `variant`
    names what else than input shapes changes a forward's work (which policy computes)."""

    def __init__(self, *modules: torch.nn.Module, variant=lambda: None):
        self.variant = variant
        self.per_shape: dict[tuple, int] = {}
        self.flops = 0.0
        self.forwards = 0
        self.graph_forwards = 0
        self._depth = 0
        self._since: float | None = None  # the first forward after the last take()
        self._counter: FlopCounterMode | None = None
        self._pending: tuple | None = None
        self._compiled = False  # some block's forward is compiled (`compile_forward`)
        for module in modules:
            module.register_forward_pre_hook(self._before, with_kwargs=True)
            module.register_forward_hook(self._after, with_kwargs=True)

    def compile_forward(self, module: torch.nn.Module) -> None:
        """`torch.compile` the forward of a metered module or of a block inside one. The counting
        forward (the first of each shape) runs eager: dynamo does not trace under a dispatch mode
        such as the FLOP counter and, having refused a code object once, never compiles it
        afterwards. A forward that builds a graph is counted by a separate eager forward without
        one, and then runs compiled: a checkpointed block recomputes in the backward, outside the
        counter, and must run the same code as its forward did."""
        self._compiled = True
        eager = module.forward
        compiled = torch.compile(eager)

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            return (eager if self._counter is not None else compiled)(*args, **kwargs)

        module.forward = forward

    def _before(self, module, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            if self._since is None:
                self._since = time.perf_counter()
            key = (self.variant(), _shape_key(args, kwargs))
            self._pending = (key, torch.is_grad_enabled())
            if key not in self.per_shape:
                self._counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
                self._counter.__enter__()
                if self._compiled and torch.is_grad_enabled():
                    with torch.no_grad():
                        module.forward(*args, **kwargs)  # no hooks: not a forward of the run
                    self._stop_counting(key)

    def _after(self, module, args, kwargs, output):
        self._depth -= 1
        if self._depth:
            return
        key, builds_graph = self._pending
        if self._counter is not None:
            self._stop_counting(key)
        self.flops += self.per_shape[key] * (3 if builds_graph else 1)
        self.forwards += 1
        self.graph_forwards += int(builds_graph)

    def _stop_counting(self, key) -> None:
        self._counter.__exit__(None, None, None)
        self.per_shape[key] = self._counter.get_total_flops()
        self._counter = None

    def take(self, peak_flops: float) -> dict[str, float]:
        """`perf/*` metrics of the forwards since the last call (then reset): model FLOPs, the
        achieved FLOP/s over the wall time from the first of those forwards to now (so the gaps
        inside a step, e.g. waiting for rewards, count against utilisation), and MFU against
        `peak_flops`."""
        seconds = time.perf_counter() - self._since if self._since is not None else 0.0
        achieved = self.flops / seconds if seconds > 0 else 0.0
        metrics = {"perf/tflop": self.flops / 1e12, "perf/achieved_tflops": achieved / 1e12,
                   "perf/mfu": achieved / peak_flops, "perf/peak_tflops": peak_flops / 1e12,
                   "perf/denoiser_forwards": float(self.forwards), "perf/denoiser_backwards": float(self.graph_forwards)}
        self.flops, self.forwards, self.graph_forwards, self._since = 0.0, 0, 0, None
        return metrics


def matmul_peak_flops(device: torch.device | str, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best achieved FLOP/s of a square matmul on `device` in `dtype` (measured once per process)."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _PEAKS:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        _PEAKS[key] = 2 * size ** 3 / best
    return _PEAKS[key]


def peak_memory_gb(device: torch.device | str) -> float:
    """This process's peak memory so far, in GB: the most ever allocated on a CUDA device (what
    `torch.cuda.max_memory_allocated` reports, verl's `perf/max_memory_allocated_gb`), and on the
    CPU the peak resident set of the process (weights, activations, optimizer and everything
    else it holds)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:  # Linux: this process image's high-water mark. getrusage's ru_maxrss would also count the
        # parent's resident set, which a child inherits through fork/vfork + exec.
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB elsewhere
