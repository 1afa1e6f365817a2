"""Merging a vision-language checkpoint's weights into its base (`pixelrl export` on a vlm_ppo
run; `pixelrl.vlm.export` reads the checkpoint and writes the folder).

The checkpoint's `actor/actor.safetensors` holds the trainable weights under the names the policy
trained them with: every parameter (full fine-tuning) or the LoRA factors of the language model's
projections. The export loads the base folder, writes the trained weights into it (a LoRA pair
merged as W + (alpha / r) B A, peft's scaling) and saves model, tokenizer and image processor, so
transformers and every Qwen2-VL server load the result without pixelrl or peft.
"""

from __future__ import annotations

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
