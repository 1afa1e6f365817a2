"""Export a vision-language checkpoint as a plain Qwen2-VL folder (`pixelrl export` on a vlm_ppo run).

The checkpoint's `actor/actor.safetensors` holds the trainable weights under the names the policy
trained them with: every parameter (full fine-tuning) or the LoRA factors of the language model's
projections. The export loads the base folder, writes the trained weights into it (a LoRA pair
merged as W + (alpha / r) B A, peft's scaling) and saves model, tokenizer and image processor, so
transformers and every Qwen2-VL server load the result without pixelrl or peft.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pixelrl.core.errors import ModelFolderError

LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"


def merged_state(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], *, rank: int,
                 alpha: float) -> dict[str, torch.Tensor]:
    """The base state with the trained weights in it: full weights replace theirs, a LoRA pair
    adds (alpha / rank) B A to the weight it wraps. Names that fit nothing are an error."""
    out = dict(base)
    for name, value in trained.items():
        if name.endswith(LORA_B):
            continue
        if name.endswith(LORA_A):
            target = name[:-len(LORA_A)] + ".weight"
            partner = name[:-len(LORA_A)] + LORA_B
            if target not in base or partner not in trained:
                raise ModelFolderError(f"LoRA factor `{name}` has no {'base weight' if target not in base else 'B factor'}"
                                       " to merge into: the checkpoint does not belong to this base model")
            delta = (alpha / rank) * (trained[partner].double() @ value.double())
            out[target] = (base[target].double() + delta).to(base[target].dtype)
        elif name in base:
            out[name] = value.to(base[name].dtype)
        else:
            raise ModelFolderError(f"checkpoint weight `{name}` is not in the base model: the checkpoint does not "
                                   "belong to this base model (pass the folder it trained from with --base-model)")
    return out


def export_vlm_checkpoint(actor_dir: str | Path, base_model: str | Path, out: str | Path, *, lora_rank: int,
                          lora_alpha: float, weights: str = "actor") -> Path:
    """Write the base folder with the checkpoint's weights merged in to `out`; returns it.
    `weights`: `actor` (the trained policy) or `ema` (its exponential moving average, kept when
    vlm.ema_decay > 0 and scored by validation when vlm.validate_ema)."""
    from safetensors.torch import load_file

    from pixelrl.engine.checkpoint import read_checkpoint_file
    from pixelrl.engine.pretrain_vlm import save_vlm
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
