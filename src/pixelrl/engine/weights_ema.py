"""An exponential moving average of the trained weights, kept beside them.

flow_grpo and DiffusionNFT (`train.ema`) validate and save the EMA of their trained weights,
not the weights themselves; LightRFT's VLM trainer keeps one too. The average smooths the noise
of single updates, which in RL post-training is most of each update.
"""

from __future__ import annotations

import contextlib

import torch


def warmed_up_decay(step: int, decay: float) -> float:
    """The decay applied after optimizer step `step` (1-based): min((1 + s) / (10 + s), decay),
    so that the first updates follow the weights closely (flow_grpo's and DiffusionNFT's)."""
    return min((1 + step) / (10 + step), decay)


@contextlib.contextmanager
def holding(params: list[torch.Tensor], values: list[torch.Tensor]):
    """`params` hold `values` inside the block and get their own values back, bit for bit, after."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        torch._foreach_copy_(params, values)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(params, saved)


class WeightsEMA:
    """`values` track `params`: after optimizer step s, when (s + 1) % update_interval == 0,
    values <- d * values + (1 - d) * params with d = warmed_up_decay(s, decay), or d = decay
    without `warmup`."""

    def __init__(self, params: list[torch.Tensor], decay: float, update_interval: int = 1, warmup: bool = True):
        self.params = list(params)
        self.values = [p.detach().clone() for p in self.params]
        self.decay, self.update_interval, self.warmup = float(decay), int(update_interval), bool(warmup)

    @torch.no_grad()
    def update(self, step: int) -> float | None:
        """Called after optimizer step `step` (1-based); returns the decay applied, or None."""
        if (step + 1) % self.update_interval:
            return None
        decay = warmed_up_decay(step, self.decay) if self.warmup else self.decay
        torch._foreach_lerp_(self.values, [p.detach() for p in self.params], 1.0 - decay)
        return decay

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """The trained parameters take the EMA for good (evaluating a checkpoint)."""
        torch._foreach_copy_(self.params, self.values)

    def swapped_in(self):
        """The trained parameters hold the EMA inside the block (validation, evaluation)."""
        return holding(self.params, self.values)
