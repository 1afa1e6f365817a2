"""LoRA adapters on the denoiser through peft (named adapters, diffusers-compatible layout)."""

from __future__ import annotations

import contextlib

from torch import nn


def add_lora(
    transformer: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules,
    adapter_name: str = "default",
    init: str | bool = "gaussian",
) -> None:
    """Freeze the base weights and attach a trainable LoRA adapter named `adapter_name`.

    `init`: `gaussian` (A Gaussian, B zero), `default` (peft's kaiming-uniform A, B zero), or one
    of peft's data-free initialisations (`pissa`, `olora`, `orthogonal`)."""
    from peft import LoraConfig

    init = True if init == "default" else init

    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=init)
    transformer.add_adapter(config, adapter_name=adapter_name)
    transformer.set_adapter(adapter_name)
    # peft marks the active adapter trainable; make sure no base weight slipped through.
    for name, param in transformer.named_parameters():
        param.requires_grad_("lora_" in name and f".{adapter_name}." in name)


LORA_INITS = ("gaussian", "default", "pissa", "olora", "orthogonal")


@contextlib.contextmanager
def adapters_disabled(transformer: nn.Module):
    """The base model: every LoRA adapter switched off for the duration (the reference policy)."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def lora_state_dict(transformer: nn.Module, adapter_name: str = "default") -> dict:
    """The adapter's weights with peft's key names (what diffusers `load_lora_weights` reads)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name=adapter_name)
