"""`vlm_judge`: a local vision-language model asked a yes/no question about each image.

    question = template with {prompt} replaced by the image's prompt
    score    = P(yes) / (P(yes) + P(no))   of the first answer token       (two_way, default)
             = P(yes)                      over the whole vocabulary        (two_way: false)

This is the generative-reward-model recipe (UnifiedReward, GenRM): no value head, the judge's own
next-token distribution is the score, so any instruction-tuned VLM can be a reward. The model is
the VLM trainer's family (Qwen2-VL layout), loaded from a local folder, frozen, under no_grad.
"""

from __future__ import annotations

import numpy as np
import torch

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.rewards.registry import check_model_folder_option, register_reward, scoring_device

DEFAULT_TEMPLATE = 'Does this image show "{prompt}"? Answer yes or no.'


def check_judge_options(options: dict, field: str) -> None:
    # the judge is a Qwen2-VL folder: its config and its image processor's
    check_model_folder_option(options, field, needs=("config.json", "preprocessor_config.json"))
    template = options.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str) or "{prompt}" not in template:
        raise ConfigError(f"{field}.template", template, "a question containing {prompt}, e.g. " + DEFAULT_TEMPLATE)
    for key in ("yes", "no"):
        if not isinstance(options.get(key, key), str) or not options.get(key, key).strip():
            raise ConfigError(f"{field}.{key}", options.get(key), "the answer word, e.g. " + key)


def _single_token(judge, word: str, path: str) -> int:
    ids = judge.tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ModelFolderError(f"model folder `{path}`: the judge's tokenizer splits {word!r} into {len(ids)} tokens; "
                               "choose answer words (options yes / no) that are single tokens for this model")
    if ids[0] == judge.tokenizer.unk_token_id:
        raise ModelFolderError(f"model folder `{path}`: {word!r} is not in the judge's vocabulary (it reads as the "
                               "unknown token); choose answer words (options yes / no) the model knows")
    return ids[0]


@register_reward("vlm_judge")
def vlm_judge(path: str = "", template: str = DEFAULT_TEMPLATE, yes: str = "yes", no: str = "no",
              two_way: bool = True, batch_size: int = 16):
    """P(yes) of a local VLM asked `template` about each image."""
    check_judge_options({"path": path, "template": template, "yes": yes, "no": no, "batch_size": batch_size},
                        "reward.functions[].options")
    state: dict = {}

    def load():
        from pixelrl.models.qwen_vl.model import QwenVLModel

        judge = QwenVLModel(path, device=scoring_device())
        judge.model.requires_grad_(False)
        state.update(judge=judge, ids=[_single_token(judge, yes, path), _single_token(judge, no, path)])

    @torch.no_grad()
    def reward(images, prompts, metadata):
        if not state:
            load()  # where it scores (a reward worker), once
        judge, (yes_id, no_id) = state["judge"], state["ids"]
        arrays = list(np.asarray(images.detach().cpu().numpy(), dtype=np.uint8))
        # str.replace, not str.format: a prompt or template never reaches Python's format mini-language
        questions = [template.replace("{prompt}", p) for p in prompts]
        scores = []
        for start in range(0, len(arrays), batch_size):
            batch = judge.prompts(arrays[start:start + batch_size], questions[start:start + batch_size])
            logp = judge.next_token_logprobs(batch)
            if two_way:
                scores.append(torch.softmax(logp[:, [yes_id, no_id]], -1)[:, 0])
            else:
                scores.append(logp[:, yes_id].exp())
        return {"vlm_judge": torch.cat(scores).cpu()}

    return reward


vlm_judge.check_options = check_judge_options
