"""LoRA adapters on the denoiser through peft (named adapters, diffusers-compatible layout)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pixelrl.models.kernels import float32_adapters


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
    from peft.utils.error import NoMatchingPeftModuleError

    from pixelrl.core.errors import ConfigError

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=init)
    try:
        transformer.add_adapter(config, adapter_name=adapter_name)
    except NoMatchingPeftModuleError:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in transformer.named_modules()
                         if isinstance(module, nn.Linear) and not name.rsplit(".", 1)[-1].isdigit()})
        raise ConfigError("model.lora_target_modules", list(target_modules), f"no module of the denoiser matches; "
                          f"name some of its linear layers {linear}, or leave it unset for the family's "
                          "defaults") from None
    transformer.set_adapter(adapter_name)
    # peft marks the active adapter trainable; make sure no base weight slipped through.
    for name, param in transformer.named_parameters():
        param.requires_grad_("lora_" in name and f".{adapter_name}." in name)
    float32_adapters(transformer)


LORA_INITS = ("gaussian", "default", "pissa", "olora", "orthogonal")


@contextlib.contextmanager
def adapters_disabled(transformer: nn.Module):
    """The base model: every LoRA adapter switched off for the duration (the reference policy)."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def lora_config(transformer: nn.Module, adapter_name: str = "default") -> dict:
    """The adapter's peft LoraConfig as a dict (rank, alpha, targets: how to apply its weights)."""
    return transformer.peft_config[adapter_name].to_dict()


def add_adapter_copy(transformer: nn.Module, new_name: str, source: str = "default") -> None:
    """A second, frozen adapter `new_name` with the configuration and weights of `source`
    (DiffusionNFT's `old` policy, AWM's EMA). `source` stays the active, trainable adapter."""
    import copy

    import warnings

    config = copy.deepcopy(transformer.peft_config[source])
    with warnings.catch_warnings():  # peft warns about a second adapter: here that is the point
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        transformer.add_adapter(config, adapter_name=new_name)
    float32_adapters(transformer)  # before the copy: a bf16 copy would round the source's weights
    blend_adapter(transformer, new_name, source, decay=0.0)
    activate_adapter(transformer, source)


def add_adapter_from_folder(transformer: nn.Module, new_name: str, folder, restore: str = "default") -> None:
    """A frozen adapter `new_name` read from a diffusers LoRA folder (pytorch_lora_weights.safetensors,
    its LoraConfig in the file's metadata, as `save_lora` writes it); `restore` stays the active,
    trainable adapter."""
    import warnings

    with warnings.catch_warnings():  # peft warns about a second adapter: here that is the point
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        transformer.load_lora_adapter(str(folder), adapter_name=new_name, prefix="transformer",
                                      weight_name="pytorch_lora_weights.safetensors", use_safetensors=True)
    float32_adapters(transformer)
    activate_adapter(transformer, restore)


def lora_modules_absent(transformer: nn.Module, folder) -> tuple[list[str], int]:
    """The modules a diffusers LoRA folder's file adapts that `transformer` lacks, and how many it
    adapts in all: diffusers applies the tensors that fit and drops the rest without a word, so a
    LoRA of a deeper or another model would be applied in part."""
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(Path(folder) / "pytorch_lora_weights.safetensors"), "pt") as file:
        keys = list(file.keys())
    adapted = sorted({key.split(".lora_")[0].removeprefix("transformer.") for key in keys if ".lora_" in key})
    present = {name for name, _ in transformer.named_modules()}
    return [name for name in adapted if name not in present], len(adapted)


def activate_adapter(transformer: nn.Module, name: str) -> None:
    """Make `name` the only active adapter; its LoRA weights (only) are trainable when `name`
    is the training adapter, every other parameter stays frozen."""
    transformer.set_adapter(name)
    for pname, param in transformer.named_parameters():
        param.requires_grad_("lora_" in pname and f".{name}." in pname and name == "default")


@contextlib.contextmanager
def adapter_active(transformer: nn.Module, name: str, restore: str = "default"):
    """Compute with adapter `name` for the duration (e.g. the old policy), then switch back."""
    activate_adapter(transformer, name)
    try:
        yield
    finally:
        activate_adapter(transformer, restore)


def adapter_params(transformer: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The LoRA parameters of adapter `name`, keyed by their name with the adapter removed."""
    return {n.replace(f".{name}.", "."): p for n, p in transformer.named_parameters()
            if "lora_" in n and f".{name}." in n}


@torch.no_grad()
def blend_adapter(transformer: nn.Module, target: str, source: str, decay: float) -> None:
    """target = decay * target + (1 - decay) * source, parameter by parameter (decay 0 copies)."""
    targets, sources = adapter_params(transformer, target), adapter_params(transformer, source)
    if targets.keys() != sources.keys():
        raise ValueError(f"adapters `{target}` and `{source}` have different parameters")
    for key, param in targets.items():
        src = sources[key]
        src = src.full_tensor() if hasattr(src, "full_tensor") and not hasattr(param, "full_tensor") else src
        param.mul_(decay).add_(src.to(param.dtype), alpha=1.0 - decay)
