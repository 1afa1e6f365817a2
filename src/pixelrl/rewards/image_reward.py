"""ImageReward (Xu et al., 2023) from a local folder, on transformers' BLIP.

    image_reward = (MLP(BLIP text encoder([CLS] prompt | image)[CLS]) - 0.16717) / 1.03334

The image goes through BLIP's ViT (224 px, CLIP's normalisation); the prompt (padded to 35
tokens) through BLIP's BERT text encoder with cross-attention to every image token; the [CLS]
feature through a 768-1024-128-64-16-1 MLP (the aesthetic predictor's shape, no activations);
the result is standardised with the constants ImageReward ships. Flow-GRPO and DanceGRPO use it
as a human-preference reward.

The folder (written by `pixelrl convert-reward image_reward` from the released `ImageReward.pt` and a
local BLIP image-text-matching folder) holds a transformers `BlipForImageTextRetrieval`
(config.json + model.safetensors, tokenizer and preprocessor files) and `head.safetensors`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pixelrl.rewards.clip import aesthetic_head
from pixelrl.rewards.registry import check_model_folder_option, loaded_on_first_call, register_reward, scoring_device

# ImageReward's standardisation of the MLP's output (from its release)
MEAN, STD = 0.16717362830052426, 1.0333394966054072
MAX_PROMPT_TOKENS = 35
HEAD_WIDTH = 768  # BLIP's BERT-base text encoder


class _Head(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = aesthetic_head(width)


class ImageRewardModel:
    """BLIP's vision and text encoders and the MLP head from `path`, frozen, batched."""

    def __init__(self, path: str, batch_size: int = 32):
        from safetensors.torch import load_file
        from transformers import BlipForImageTextRetrieval, BlipProcessor

        from pixelrl.models.base import load_part

        self.device, self.batch_size = scoring_device(), batch_size
        blip = load_part(path, "BLIP model", lambda: BlipForImageTextRetrieval.from_pretrained(path, use_safetensors=True))
        self.vision, self.text = blip.vision_model, blip.text_encoder
        for part in (self.vision, self.text):
            part.eval().requires_grad_(False).to(self.device)
        self.processor = load_part(path, "BLIP processor", lambda: BlipProcessor.from_pretrained(path))

        def load_head():
            head = _Head(blip.config.text_config.hidden_size)
            head.load_state_dict(load_file(str(Path(path) / "head.safetensors")))
            return head

        self.head = load_part(path, "head.safetensors", load_head).eval().requires_grad_(False).to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        arrays = list(images.detach().cpu().numpy())
        out = []
        for start in range(0, len(arrays), self.batch_size):
            pixels = self.processor(images=arrays[start:start + self.batch_size], return_tensors="pt")["pixel_values"]
            image_tokens = self.vision(pixel_values=pixels.to(self.device)).last_hidden_state
            text = self.processor.tokenizer(prompts[start:start + self.batch_size], padding="max_length",
                                            truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt")
            features = self.text(input_ids=text["input_ids"].to(self.device),
                                 attention_mask=text["attention_mask"].to(self.device),
                                 encoder_hidden_states=image_tokens,
                                 encoder_attention_mask=torch.ones(image_tokens.shape[:-1], dtype=torch.long,
                                                                   device=self.device)).last_hidden_state[:, 0]
            out.append(self.head.layers(features.float()).squeeze(-1))
        return ((torch.cat(out) - MEAN) / STD).float().cpu()


def check_image_reward_options(options: dict, field: str) -> None:
    check_model_folder_option(options, field, needs=("config.json", "head.safetensors"))


@register_reward("image_reward")
def image_reward(path: str = "", batch_size: int = 32):
    """ImageReward's standardised human-preference score of each (prompt, image) pair (about -2..2)."""
    check_image_reward_options({"path": path, "batch_size": batch_size}, "reward.functions[].options")
    return loaded_on_first_call(lambda: ImageRewardModel(path, batch_size),
                                lambda model, images, prompts: {"image_reward": model(images, prompts)})


image_reward.check_options = check_image_reward_options


# ------------------------------------------------------------------------------ conversion
def _vision_name(key: str) -> str:
    """BLIP's ViT (timm layout) -> transformers' BlipVisionModel."""
    fixed = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
             "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
             "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
             "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
    if key in fixed:
        return fixed[key]
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        for old, new in (("norm1.", "layer_norm1."), ("norm2.", "layer_norm2."), ("attn.proj.", "self_attn.projection."),
                         ("attn.qkv.", "self_attn.qkv."), ("mlp.", "mlp.")):
            if rest.startswith(old):
                return f"encoder.layers.{index}.{new}{rest[len(old):]}"
    raise KeyError(key)


def convert_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """ImageReward.pt's tensors -> (BlipForImageTextRetrieval state dict, head state dict).
    The text encoder (BLIP's BERT with cross-attention) already uses transformers' names."""
    model, head, unknown = {}, {}, []
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            try:
                model["vision_model." + _vision_name(key[len("blip.visual_encoder."):])] = value
            except KeyError:
                unknown.append(key)
        elif key.startswith("blip.text_encoder."):
            name = key[len("blip.text_encoder."):]
            if not name.endswith("position_ids"):  # a buffer, rebuilt by transformers
                model["text_encoder." + name] = value
        elif key.startswith(("blip.vision_proj.", "blip.text_proj.")):
            model[key[len("blip."):]] = value  # unused by the score; kept so the BLIP model is whole
        elif key.startswith("mlp.layers."):
            head[key[len("mlp."):]] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an ImageReward checkpoint: unexpected tensors {unknown[:5]}")
    return model, head


def convert_checkpoint(checkpoint: str | Path, blip_folder: str | Path, out: str | Path) -> Path:
    """Write an `image_reward` folder from ImageReward's released `ImageReward.pt` (a state dict,
    read as tensors only) and a local transformers BLIP image-text-matching folder of the same
    size (ViT-L, e.g. a copy of blip-itm-large-coco) that gives the config, tokenizer and
    processor; the image size is the checkpoint's own (224)."""
    from safetensors.torch import save_file
    from transformers import BlipConfig, BlipForImageTextRetrieval, BlipProcessor

    from pixelrl.core.errors import ModelFolderError
    from pixelrl.rewards.conversion import load_weights, read_state_dict, rename

    weights, head = rename(checkpoint, convert_state_dict, read_state_dict(checkpoint, "ImageReward.pt"))
    for name in ("pos_embed", "patch_embed.proj.weight"):
        if "vision_model." + _vision_name(name) not in weights:
            raise ModelFolderError(f"checkpoint `{checkpoint}` lacks blip.visual_encoder.{name}")
    blip_folder, out = Path(blip_folder), Path(out)
    config_dict = json.loads((blip_folder / "config.json").read_text())
    # the image size the ViT was trained at (224 for ImageReward), read off its position table
    patch = weights["vision_model.embeddings.patch_embedding.weight"].shape[-1]
    image_size = round((weights["vision_model.embeddings.position_embedding"].shape[1] - 1) ** 0.5) * patch
    config_dict.setdefault("vision_config", {})["image_size"] = image_size
    model = BlipForImageTextRetrieval(BlipConfig.from_dict(config_dict))
    load_weights(model, weights, checkpoint, blip_folder, lambda k: k.startswith(("vision_model.", "text_encoder.")))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor = BlipProcessor.from_pretrained(blip_folder)
    processor.image_processor.size = {"height": image_size, "width": image_size}
    processor.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in head.items()}, str(out / "head.safetensors"))
    return out
