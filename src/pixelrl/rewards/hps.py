"""HPSv2 / HPSv2.1 (Wu et al., 2023) from a local folder, on transformers' CLIP.

    hpsv2 = cos(CLIP image embedding, CLIP text embedding)

HPSv2 is OpenCLIP's ViT-H-14 fine-tuned on human preference pairs; its score is the cosine of the
normalised embeddings (no logit scale), about 0.2-0.35 for typical images. DanceGRPO trains
against HPSv2.1. OpenCLIP's model code is not used: `pixelrl convert-hpsv2` renames the released
checkpoint's tensors into a transformers `CLIPModel` folder (the architectures are the same),
with the config, tokenizer and processor of a local copy of the base model
(laion/CLIP-ViT-H-14-laion2B-s32B-b79K).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pixelrl.rewards.clip import ClipBackbone
from pixelrl.rewards.registry import check_model_folder_option, loaded_on_first_call, register_reward


@register_reward("hpsv2")
def hpsv2(path: str = "", batch_size: int = 32):
    """The HPSv2(.1) preference score of each (prompt, image) pair: the cosine of the embeddings."""
    check_model_folder_option({"path": path, "batch_size": batch_size}, "reward.functions[].options")
    return loaded_on_first_call(
        lambda: ClipBackbone(path, batch_size),
        lambda clip, images, prompts: {"hpsv2": (clip.image_embeds(images) * clip.text_embeds(prompts)).sum(-1).cpu()})


hpsv2.check_options = lambda options, field: check_model_folder_option(options, field)


# ------------------------------------------------------------------------------ conversion
_BLOCK = {"ln_1.": "layer_norm1.", "ln_2.": "layer_norm2.", "attn.out_proj.": "self_attn.out_proj.",
          "mlp.c_fc.": "mlp.fc1.", "mlp.c_proj.": "mlp.fc2."}


def _tower(prefix: str, key: str, value: torch.Tensor, out: dict[str, torch.Tensor]) -> bool:
    """One tensor of an OpenCLIP transformer block (`...resblocks.N.<rest>`) into `out`."""
    index, rest = key.split(".", 1)
    layer = f"{prefix}.encoder.layers.{index}."
    if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):  # packed q, k, v
        kind = "weight" if rest.endswith("weight") else "bias"
        for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3)):
            out[f"{layer}self_attn.{name}.{kind}"] = part.contiguous()
        return True
    for old, new in _BLOCK.items():
        if rest.startswith(old):
            out[layer + new + rest[len(old):]] = value
            return True
    return False


def convert_open_clip_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenCLIP (or OpenAI CLIP) state dict -> transformers CLIPModel names."""
    fixed = {"visual.class_embedding": "vision_model.embeddings.class_embedding",
             "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
             "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
             "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
             "positional_embedding": "text_model.embeddings.position_embedding.weight",
             "logit_scale": "logit_scale"}
    renamed = {"visual.ln_pre.": "vision_model.pre_layrnorm.", "visual.ln_post.": "vision_model.post_layernorm.",
               "ln_final.": "text_model.final_layer_norm."}
    out, unknown = {}, []
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in fixed:
            out[fixed[key]] = value
        elif key in ("visual.proj", "text_projection"):  # x @ proj in OpenCLIP, a Linear's weight here
            out["visual_projection.weight" if key == "visual.proj" else "text_projection.weight"] = value.t().contiguous()
        elif key == "attn_mask":
            continue  # the causal mask, a buffer transformers builds itself
        elif any(key.startswith(old) for old in renamed):
            old = next(o for o in renamed if key.startswith(o))
            out[renamed[old] + key[len(old):]] = value
        elif key.startswith("visual.transformer.resblocks."):
            _tower("vision_model", key[len("visual.transformer.resblocks."):], value, out) or unknown.append(key)
        elif key.startswith("transformer.resblocks."):
            _tower("text_model", key[len("transformer.resblocks."):], value, out) or unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an OpenCLIP checkpoint: unexpected tensors {unknown[:5]}")
    return out


def convert_checkpoint(checkpoint: str | Path, clip_folder: str | Path, out: str | Path) -> Path:
    """Write an `hpsv2` folder from HPS's released checkpoint (`HPS_v2.1_compressed.pt`: a dict
    with a `state_dict`, read as tensors only) and a local transformers copy of its base model
    (CLIP-ViT-H-14-laion2B-s32B-b79K) for the config, tokenizer and processor."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    from pixelrl.rewards.conversion import load_weights, read_state_dict, rename

    weights = rename(checkpoint, convert_open_clip_state, read_state_dict(checkpoint, "HPS_v2.1_compressed.pt"))
    clip_folder, out = Path(clip_folder), Path(out)
    model = CLIPModel(CLIPConfig.from_dict(json.loads((clip_folder / "config.json").read_text())))
    load_weights(model, weights, checkpoint, clip_folder, lambda k: True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    CLIPProcessor.from_pretrained(clip_folder).save_pretrained(out)
    return out
