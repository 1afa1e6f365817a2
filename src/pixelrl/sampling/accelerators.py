"""Rollout accelerators (`rollout.accelerator`), each marked lossless or lossy.

A lossless accelerator samples what the plain sampler samples; a lossy one samples something
close to it, cheaper. A lossy rollout is allowed only for methods whose update does not re-score
the rollout's own steps (the forward-process methods read only the clean sample), never for the
transition family, whose log-probabilities and ratios must be the sampler's exact computation
(config/validation.py reads the mark). Validation and evaluation never use one.

`first_block_cache` (lossy): within one sampling call, after each step's first transformer block
the change of that block's residual (hidden-state output minus input) since the last fully
computed step is compared with the threshold: mean |r - r_last| / mean |r_last|. Below it, the
step skips the other blocks of the cached span and adds their residual from the last computed
step instead (the first-block cache of ParaAttention, a simpler relative of TeaCache). The span
is the denoiser's `transformer_blocks` but the last, which always runs (SD3's last block has no
text output to cache). The decision is one per forward, so a sample's image depends on the other
samples of its micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from pixelrl.core.errors import ConfigError, check_number
from pixelrl.core.registry import Registry

ACCELERATORS: Registry = Registry("rollout accelerator", "rollout.accelerator")


@dataclass(frozen=True)
class Accelerator:
    name: str
    lossless: bool
    # (denoiser module, params dict) -> a context manager active over one sampling call, which
    # yields an object whose `counts` (a dict of ints: forwards, skipped) the rollout records
    apply: Callable
    check: Callable[[dict], None] = lambda params: None


def register_accelerator(spec: Accelerator) -> Accelerator:
    ACCELERATORS.register(spec.name)(spec)
    return spec


@contextlib.contextmanager
def no_accelerator(transformer, params: dict):
    yield SimpleNamespace(counts={})


def _check_no_params(params: dict) -> None:
    if params:
        raise ConfigError("rollout.accelerator_params", params, "rollout.accelerator=none takes no params: leave "
                          "them empty, or name the accelerator they are for")


register_accelerator(Accelerator("none", lossless=True, apply=no_accelerator, check=_check_no_params))


@dataclass
class _CacheState:
    threshold: float
    head_residual: torch.Tensor | None = None
    tail_residuals: tuple | None = None  # the span's (hidden, encoder) output minus the head's
    head_output: tuple | None = None
    computing: bool = True
    # forwards, skipped, and the indices (in this call's forwards) of the skipped ones
    counts: dict = field(default_factory=lambda: {"forwards": 0, "skipped": 0})
    skipped_at: list = field(default_factory=list)


def _split(output, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden states, encoder hidden states or None) of a block's output."""
    if not isinstance(output, tuple):
        return output, None
    encoder = output[meta.return_encoder_hidden_states_index] if meta.return_encoder_hidden_states_index is not None \
        else None
    return output[meta.return_hidden_states_index], encoder


def _join(hidden, encoder, meta, like):
    """A block's output in its own layout from (hidden, encoder)."""
    if not isinstance(like, tuple):
        return hidden
    out = [None] * len(like)
    out[meta.return_hidden_states_index] = hidden
    if meta.return_encoder_hidden_states_index is not None:
        out[meta.return_encoder_hidden_states_index] = encoder
    return tuple(out)


def _head_forward(block, original, meta, state: _CacheState):
    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        hidden, encoder = _split(output, meta)
        residual = hidden - meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        state.counts["forwards"] += 1
        if state.head_residual is not None and state.tail_residuals is not None:
            change = (residual - state.head_residual).abs().mean() / state.head_residual.abs().mean()
            state.computing = bool(change > state.threshold)
        else:
            state.computing = True
        if state.computing:
            state.head_residual, state.head_output = residual, (hidden, encoder)
            return output
        state.counts["skipped"] += 1
        state.skipped_at.append(state.counts["forwards"] - 1)
        tail_hidden, tail_encoder = state.tail_residuals
        return _join(hidden + tail_hidden, None if encoder is None else encoder + tail_encoder, meta, output)
    return forward


def _span_forward(block, original, meta, state: _CacheState, is_tail: bool):
    def forward(*args, **kwargs):
        if not state.computing:  # the head already added the span's cached residual: pass through
            hidden = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            encoder = meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs) \
                if meta.return_encoder_hidden_states_index is not None else None
            return _join(hidden, encoder, meta, (None, None) if encoder is not None else hidden)
        output = original(*args, **kwargs)
        if is_tail:
            hidden, encoder = _split(output, meta)
            head_hidden, head_encoder = state.head_output
            state.tail_residuals = (hidden - head_hidden, None if encoder is None else encoder - head_encoder)
        return output
    return forward


@contextlib.contextmanager
def first_block_cache(transformer, params: dict):
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = list(getattr(transformer, "transformer_blocks", []))
    if len(blocks) < 3:
        raise ConfigError("rollout.accelerator", "first_block_cache", f"caches the blocks between the first and the "
                          f"last, and this denoiser has {len(blocks)} transformer blocks: use rollout.accelerator=none")
    state = _CacheState(float(params.get("threshold", 0.1)))
    span = blocks[:-1]  # the last block always runs
    try:
        for i, block in enumerate(span):
            meta = TransformerBlockRegistry.get(type(block))
            original = block.forward
            block.forward = (_head_forward(block, original, meta, state) if i == 0
                             else _span_forward(block, original, meta, state, is_tail=i == len(span) - 1))
        yield state
    finally:
        for block in span:
            block.__dict__.pop("forward", None)  # back to the class's forward


def _check_first_block_cache(params: dict) -> None:
    unknown = sorted(set(params) - {"threshold"})
    if unknown:
        raise ConfigError("rollout.accelerator_params", params, f"first_block_cache takes `threshold` only, not {unknown}")
    check_number("rollout.accelerator_params.threshold", params.get("threshold", 0.1))


register_accelerator(Accelerator("first_block_cache", lossless=False, apply=first_block_cache,
                                 check=_check_first_block_cache))
