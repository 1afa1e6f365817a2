"""How a loaded model's modules compute: a fused kernel for diffusers' RMS norm and float32 LoRA
weights that multiply in the activations' dtype, swapped in by class, and float32 master weights
under autocast for fully trained modules (the diffusion denoisers and the vision-language policy
and critic).

Each swap keeps the module's parameters and their names, so checkpoints, LoRA export and FSDP2's
sharding see the same module. The H200 profile of the SD3.5-M step put half its time in small
memory-bound kernels, a quarter of those in diffusers' RMS norm.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn


class FusedRMSNorm(nn.Module):
    """diffusers' `RMSNorm` through `F.rms_norm`: one fused kernel on CUDA where diffusers runs
    a float32 cast, `pow`, `mean`, `rsqrt` and two multiplies (the q/k norm of every attention).
    Both normalise in float32, round to the input's dtype, then multiply by the weight. Mixed
    into a subclass of diffusers' class (`fuse_rms_norms`), so isinstance checks still hold."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # diffusers rounds to the weight's dtype: keep its order
            return super().forward(hidden_states)
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.eps)


class AdapterFactorLinear(nn.Linear):
    """One factor of a LoRA adapter (lora_A or lora_B) whose weight is float32, the optimizer's
    master copy, and multiplies in the input's dtype: a bf16 activation meets a bf16 copy of the
    small weight, as torch.autocast does for the reference implementations' float32 adapters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


@functools.cache
def _fused_diffusers_rms_norm() -> type:
    from diffusers.models.normalization import RMSNorm

    return type("FusedRMSNorm", (FusedRMSNorm, RMSNorm), {})


def fuse_rms_norms(root: nn.Module) -> int:
    """Swap every diffusers `RMSNorm` under `root` that has a weight and no bias for `FusedRMSNorm`;
    returns how many."""
    from diffusers.models.normalization import RMSNorm

    fused = _fused_diffusers_rms_norm()
    swapped = 0
    for module in root.modules():
        if type(module) is RMSNorm and module.weight is not None and getattr(module, "bias", None) is None:
            module.__class__ = fused
            swapped += 1
    return swapped


def float32_adapters(root: nn.Module) -> int:
    """Every LoRA adapter under `root` on a low-precision base layer keeps float32 weights and
    multiplies in the activations' dtype (`AdapterFactorLinear`); returns how many factors changed.

    diffusers' `add_adapter` creates the adapter in the base weights' dtype, so a bf16 denoiser
    would train bf16 LoRA weights: AdamW's small steps round away against a bf16 weight (an
    update under 1/256 of the weight is lost). The reference implementations train float32
    adapters under autocast; this is that arithmetic. A float32 model is untouched, bit for bit."""
    from peft.tuners.lora import LoraLayer

    swapped = 0
    for module in root.modules():
        if not isinstance(module, LoraLayer) or module.get_base_layer().weight.dtype == torch.float32:
            continue
        module.cast_input_dtype_enabled = False  # no float32 copy of each adapted activation
        for factor in (*module.lora_A.values(), *module.lora_B.values()):
            if type(factor) is nn.Linear:
                factor.float().__class__ = AdapterFactorLinear
                swapped += 1
    return swapped


def float32_master_weights(module: nn.Module, dtype: torch.dtype) -> bool:
    """For a fully trained module whose compute dtype is bf16 (or fp16): its weights become
    float32 and its forwards are to run under `master_weights_autocast`, as the reference
    implementations' mixed precision trains (AdamW steps under 1/256 of a bf16 weight round
    away: lr 1e-5 on weights of 0.02 loses most of them). Returns whether it did; a float32
    module is left as it is."""
    if dtype == torch.float32:
        return False
    module.float()
    return True


def master_weights_autocast(device: torch.device, dtype: torch.dtype, enabled: bool):
    """The context a module with float32 master weights computes in: autocast to `dtype`;
    nothing when `enabled` is False (an autocast around the call stays as it is)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
