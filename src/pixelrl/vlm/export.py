"""Export a vision-language checkpoint as a plain Qwen2-VL folder (`pixelrl export` on a vlm_ppo
run): the base model with the trained weights merged in (`models.qwen_vl.export.merged_state`),
saved with its tokenizer and image processor, so transformers loads it without pixelrl or peft."""

from __future__ import annotations

from pathlib import Path

from pixelrl.core.errors import ModelFolderError
from pixelrl.models.qwen_vl.export import LORA_A, merged_state

def export_vlm_checkpoint(actor_dir: str | Path, base_model: str | Path, out: str | Path, *, lora_rank: int,
                          lora_alpha: float, weights: str = "actor") -> Path:
    """Write the base folder with the checkpoint's weights merged in to `out`; returns it.
    `weights`: `actor` (the trained policy) or `ema` (its exponential moving average, kept when
    vlm.ema_decay > 0 and scored by validation when vlm.validate_ema)."""
    from safetensors.torch import load_file

    from pixelrl.engine.checkpoint import read_checkpoint_file
    from pixelrl.vlm.pretrain import save_vlm
    from pixelrl.models.qwen_vl.model import QwenVLModel

    actor_dir, out = Path(actor_dir), Path(out)
    if not (actor_dir / f"{weights}.safetensors").is_file():
        raise ModelFolderError(f"`{actor_dir}` holds no {weights}.safetensors" + (
            " (the run kept no EMA: vlm.ema_decay was 0): export the actor with --weights actor" if weights == "ema"
            else ""))
    trained = read_checkpoint_file(actor_dir / f"{weights}.safetensors", load_file)
    is_lora = any(n.endswith(LORA_A) for n in trained)
    if is_lora != (lora_rank > 0):
        raise ModelFolderError(f"`{actor_dir}` holds {'LoRA factors' if is_lora else 'full weights'} but its run's "
                               f"model.lora_rank is {lora_rank}: the checkpoint and its config.yaml disagree")
    policy = QwenVLModel(base_model)
    merged = merged_state(policy.model.state_dict(), trained, rank=max(lora_rank, 1), alpha=lora_alpha)
    policy.model.load_state_dict(merged)
    save_vlm(policy, out)
    return out
