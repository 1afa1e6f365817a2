"""Export a trained checkpoint as something diffusers loads on its own: a standalone pipeline
folder (LoRA fused into the base weights) or an adapter folder for `load_lora_weights`."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file

from pixelrl.core.errors import ModelFolderError
from pixelrl.models.base import load_part


def _load_pipeline(base: Path):
    from diffusers import StableDiffusion3Pipeline

    kwargs = {}
    if not (base / "text_encoder_3").is_dir():
        kwargs.update(text_encoder_3=None, tokenizer_3=None)
    if not (base / "vae").is_dir():
        # A pixel-space model: diffusers loads it with vae=None and samples with
        # output_type="latent" (the latents are the image in [-1, 1]).
        kwargs.update(vae=None)
    return load_part(base, "pipeline", lambda: StableDiffusion3Pipeline.from_pretrained(
        base, use_safetensors=True, **kwargs))


def export_checkpoint(actor_dir: str | Path, base_model: str | Path, out: str | Path, *, adapter_only: bool = False) -> Path:
    from pixelrl.core.assets import resolve

    actor_dir, base_model, out = Path(actor_dir), Path(resolve(str(base_model))), Path(out)
    adapter = actor_dir / "adapter"
    if adapter_only:
        if not adapter.is_dir():
            raise ModelFolderError(f"`{actor_dir}` holds no LoRA adapter (a full fine-tune): export without --adapter-only")
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        return out
    pipe = _load_pipeline(base_model)
    if adapter.is_dir():
        pipe.load_lora_weights(adapter)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    else:
        state = load_file(str(actor_dir / "trainable.safetensors"))
        missing, unexpected = pipe.transformer.load_state_dict(state, strict=False)
        if unexpected:
            raise ModelFolderError(f"`{actor_dir}` weights do not match the base transformer: {unexpected[:3]}")
    pipe.save_pretrained(out, safe_serialization=True)
    return out
