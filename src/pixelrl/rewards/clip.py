"""Model-based scores on a CLIP backbone loaded from a local folder (no hub access).

    clip_score  = exp(logit_scale) * cos(image, prompt) / divisor     (Flow-GRPO divides by 30)
    pickscore   = exp(logit_scale) * cos(image, prompt) / divisor     (PickScore weights; / 26)
    aesthetic   = MLP(image embedding / |image embedding|)            (LAION aesthetic predictor v2)

The folder is a transformers CLIPModel (config.json + model.safetensors) with its processor
files (preprocessor_config.json and the tokenizer). Scoring runs in eval mode under no_grad,
`batch_size` images at a time, on the GPU when the reward worker has one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pixelrl.rewards.registry import (check_model_folder_option, check_number_option, loaded_on_first_call,
                                      register_reward, scoring_device)

AESTHETIC_HIDDEN = (1024, 128, 64, 16)


def _pooled(output) -> torch.Tensor:
    """get_*_features returns a tensor in older transformers and an output with pooler_output in newer."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipBackbone:
    """A CLIPModel and its processor from `path`, frozen, with batched normalised embeddings."""

    def __init__(self, path: str, batch_size: int = 32, processor_path: str | None = None):
        from transformers import CLIPModel, CLIPProcessor

        from pixelrl.models.base import load_part

        self.device, self.batch_size = scoring_device(), batch_size
        self.model = load_part(path, "CLIP model", lambda: CLIPModel.from_pretrained(path, use_safetensors=True))
        self.model.eval().requires_grad_(False).to(self.device)
        processor_path = processor_path or path
        self.processor = load_part(processor_path, "CLIP processor", lambda: CLIPProcessor.from_pretrained(processor_path))
        self.logit_scale = float(self.model.logit_scale.exp())

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        arrays = list(images.detach().cpu().numpy())
        out = []
        for start in range(0, len(arrays), self.batch_size):
            pixels = self.processor(images=arrays[start:start + self.batch_size], return_tensors="pt")["pixel_values"]
            out.append(_pooled(self.model.get_image_features(pixel_values=pixels.to(self.device))).float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = self.processor(text=prompts[start:start + self.batch_size], padding=True, truncation=True,
                                    return_tensors="pt")
            tokens = {k: v.to(self.device) for k, v in tokens.items()}
            out.append(_pooled(self.model.get_text_features(**tokens)).float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def similarity(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """exp(logit_scale) * cos(image_i, prompt_i): CLIP's own logit for each matched pair."""
        return self.logit_scale * (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1).cpu()


def _similarity_reward(name: str, path: str, divisor: float, batch_size: int, processor_path: str | None):
    return loaded_on_first_call(lambda: ClipBackbone(path, batch_size, processor_path),
                                lambda clip, images, prompts: {name: clip.similarity(images, prompts) / divisor})


def _check_similarity_options(options: dict, field: str) -> None:
    check_model_folder_option(options, field)
    check_number_option(options, field, "divisor", 1.0, lambda v: v > 0, "a number > 0")


@register_reward("clip_score")
def clip_score(path: str = "", divisor: float = 30.0, batch_size: int = 32, processor_path: str | None = None):
    """Prompt-image agreement of a CLIP model (e.g. a local copy of openai/clip-vit-large-patch14)."""
    _check_similarity_options({"path": path, "divisor": divisor, "batch_size": batch_size}, "reward.functions[].options")
    return _similarity_reward("clip_score", path, divisor, batch_size, processor_path)


@register_reward("pickscore")
def pickscore(path: str = "", divisor: float = 26.0, batch_size: int = 32, processor_path: str | None = None):
    """PickScore: the PickScore_v1 CLIP weights; its processor is CLIP-ViT-H-14's (`processor_path`,
    or copy those files into `path`)."""
    _check_similarity_options({"path": path, "divisor": divisor, "batch_size": batch_size}, "reward.functions[].options")
    return _similarity_reward("pickscore", path, divisor, batch_size, processor_path)


def aesthetic_head(embed_dim: int) -> nn.Sequential:
    """The LAION aesthetic predictor's MLP; the dropout slots keep its state-dict keys
    (layers.0, .2, .4, .6, .7), so a converted checkpoint loads unchanged."""
    a, b, c, d = AESTHETIC_HIDDEN
    return nn.Sequential(nn.Linear(embed_dim, a), nn.Dropout(0.2), nn.Linear(a, b), nn.Dropout(0.2), nn.Linear(b, c),
                         nn.Dropout(0.1), nn.Linear(c, d), nn.Linear(d, 1))


class _Aesthetic(nn.Module):
    def __init__(self, embed_dim: int):
        super().__init__()
        self.layers = aesthetic_head(embed_dim)


def check_aesthetic_options(options: dict, field: str) -> None:
    check_model_folder_option(options, field, needs=("clip/config.json", "head.safetensors"))


@register_reward("aesthetic")
def aesthetic(path: str = "", batch_size: int = 32):
    """LAION aesthetic score (about 1-10): `path/clip` is the CLIP ViT-L/14 folder, `path/head.safetensors`
    the MLP's weights."""
    check_aesthetic_options({"path": path, "batch_size": batch_size}, "reward.functions[].options")
    backbone, head = None, None

    def reward(images, prompts, metadata):
        nonlocal backbone, head
        if backbone is None:
            from safetensors.torch import load_file

            from pixelrl.models.base import load_part

            backbone = ClipBackbone(str(Path(path) / "clip"), batch_size)

            def load_head():
                module = _Aesthetic(backbone.model.config.projection_dim)
                module.load_state_dict(load_file(str(Path(path) / "head.safetensors")))
                return module

            head = load_part(path, "head.safetensors", load_head).eval().to(backbone.device)
        with torch.no_grad():
            return {"aesthetic": head.layers(backbone.image_embeds(images)).squeeze(-1).float().cpu()}

    return reward


clip_score.check_options = _check_similarity_options
pickscore.check_options = _check_similarity_options
aesthetic.check_options = check_aesthetic_options
