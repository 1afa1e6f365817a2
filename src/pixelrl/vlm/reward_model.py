"""`answer_reward_model`: a scalar-head reward model for the vision-language trainer.

    score = (w · h_last + b − mean) / std

h_last is the VLM backbone's final hidden state at the last token of (image, question, answer,
end-of-sequence), w and b a linear value head: the sequence-regression reward model of
OpenRLHF / LightRFT (their `value_head` or `score` prefix, their `normalize_reward` mean and std
in config.json), loaded from a local Qwen2-VL folder, frozen, under no_grad. `answer_judge` is the
generative alternative (no head; the judge's P(yes)).

The head's tensors are found in the folder's safetensors under `value_head.` or `score.` (a reward
model saved whole; another prefix with the option `head_prefix`), or in `value_head.safetensors`
beside the backbone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pixelrl.core.errors import ModelFolderError
from pixelrl.rewards.registry import check_model_folder_option, register_reward, scoring_device
from pixelrl.rewards.vlm_judge import item_images

HEAD_PREFIXES = ("value_head", "score")  # OpenRLHF's and LightRFT's defaults for critics and reward models


def read_value_head(path: str | Path, prefixes: tuple[str, ...] = HEAD_PREFIXES) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [1, H], bias [1]) of the folder's value head, from whichever safetensors holds it."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.split(".", 1)[0] in prefixes:
                    found[key] = handle.get_tensor(key)
    heads = {key.split(".", 1)[0] for key in found}
    if len(heads) != 1 or not {"weight"} <= {key.split(".", 1)[1] for key in found}:
        raise ModelFolderError(f"model folder `{path}`: no single value head in its safetensors (tensors "
                               f"{sorted(found) or 'none'} under {list(prefixes)}); save the head as "
                               "value_head.weight / value_head.bias, e.g. in value_head.safetensors, or name "
                               "its prefix with the option head_prefix")
    prefix = heads.pop()
    weight = found[f"{prefix}.weight"].reshape(1, -1).float()
    bias = found.get(f"{prefix}.bias", torch.zeros(1)).reshape(1).float()
    return weight, bias


class _RewardModel:
    """Backbone + value head, loaded on first use where it scores, once."""

    def __init__(self, path: str, batch_size: int, mean: float | None, std: float | None, head_prefix: str | None):
        self.path, self.batch_size = path, batch_size
        self.prefixes = (head_prefix,) if head_prefix else HEAD_PREFIXES
        config = json.loads((Path(path) / "config.json").read_text())
        normalise = bool(config.get("normalize_reward", False))  # OpenRLHF's flag and statistics
        self.mean = mean if mean is not None else (config.get("mean", 0.0) if normalise else 0.0)
        self.std = std if std is not None else (config.get("std", 1.0) if normalise else 1.0)
        self.policy = self.head = None

    @torch.no_grad()
    def __call__(self, images: list[np.ndarray], questions: list[str], answers: list[str]) -> torch.Tensor:
        if self.policy is None:
            from pixelrl.models.qwen_vl.model import QwenVLModel

            self.policy = QwenVLModel(self.path, device=scoring_device())
            self.policy.model.requires_grad_(False)
            self.head = tuple(t.to(self.policy.device) for t in read_value_head(self.path, self.prefixes))
        weight, bias = self.head
        scores = []
        for start in range(0, len(images), self.batch_size):
            end = start + self.batch_size
            batch = self.policy.with_responses(self.policy.prompts(images[start:end], questions[start:end]),
                                               answers[start:end])
            hidden = self.policy.model.model(**self.policy.model_inputs(batch), use_cache=False).last_hidden_state
            last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.long().fliplr().argmax(dim=1)  # the EOS
            h_last = hidden[torch.arange(len(last), device=hidden.device), last].float()
            scores.append(h_last @ weight.t() + bias)
        return ((torch.cat(scores).squeeze(-1) - self.mean) / self.std).cpu()


def check_reward_model_options(options: dict, field: str) -> None:
    from pixelrl.core.errors import ConfigError

    check_model_folder_option(options, field, needs=("config.json", "preprocessor_config.json"))
    std = options.get("std")
    if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0):
        raise ConfigError(f"{field}.std", std, "a number > 0 (the reward's standard deviation), or leave it out")


@register_reward("answer_reward_model")
def answer_reward_model(path: str = "", batch_size: int = 16, image_key: str = "image",
                        mean: float | None = None, std: float | None = None, head_prefix: str | None = None):
    """(vision-language trainer) A sequence-regression reward model's score of each answer, given
    the question's image; `mean` / `std` override the folder's normalisation; `head_prefix` names
    the head's tensors when they are neither `value_head.*` nor `score.*`."""
    check_reward_model_options({"path": path, "batch_size": batch_size, "std": std}, "reward.functions[].options")
    model = _RewardModel(path, batch_size, mean, std, head_prefix)

    def reward(responses, questions, metadata):
        images = item_images(metadata, image_key, "answer_reward_model")
        return {"answer_reward_model": model(images, questions, [r.strip() for r in responses])}

    return reward


answer_reward_model.check_options = check_reward_model_options
