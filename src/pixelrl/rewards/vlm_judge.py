"""`vlm_judge`: a local vision-language model asked a yes/no question about each image.

    question = template with {prompt} replaced by the image's prompt
    score    = P(yes) / (P(yes) + P(no))   of the first answer token       (two_way, default)
             = P(yes)                      over the whole vocabulary        (two_way: false)

This is the generative-reward-model recipe (UnifiedReward, GenRM): no value head, the judge's own
next-token distribution is the score, so any instruction-tuned VLM can be a reward. The model is
the VLM trainer's family (Qwen2-VL layout), loaded from a local folder, frozen, under no_grad.

`answer_judge` is the same judge as a reward model for the vision-language trainer: shown the
question's image, asked whether the policy's answer is correct (template with {question} and
{answer}), its P(yes) is the answer's reward.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from pixelrl.core.errors import ConfigError, ModelFolderError, RewardError
from pixelrl.rewards.registry import check_model_folder_option, register_reward, scoring_device

DEFAULT_TEMPLATE = 'Does this image show "{prompt}"? Answer yes or no.'
# with_source: the judge sees each row's source picture(s), then the edit
DEFAULT_EDIT_TEMPLATE = ('The last picture is an edit of the picture before it, asked to "{prompt}". Does it follow the '
                         'instruction and keep the rest? Answer yes or no.')
# answer_judge: a reward model for the vision-language trainer's answers
DEFAULT_ANSWER_TEMPLATE = "Question: {question}\nAnswer: {answer}\nIs the answer correct? Answer yes or no."
_PLACEHOLDER = re.compile(r"\{(prompt|question|answer)\}")


def fill(template: str, values: dict[str, str]) -> str:
    """One pass over the template's placeholders: text put in (a prompt, a model's answer) is never
    read again for placeholders, and never reaches Python's format mini-language."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def _check_options(options: dict, field: str, default: str, required: str) -> None:
    # the judge is a Qwen2-VL folder: its config and its image processor's
    check_model_folder_option(options, field, needs=("config.json", "preprocessor_config.json"))
    template = options.get("template", default)
    if not isinstance(template, str) or "{" + required + "}" not in template:
        raise ConfigError(f"{field}.template", template, "a question containing {" + required + "}, e.g. " + default)
    for key in ("yes", "no"):
        if not isinstance(options.get(key, key), str) or not options.get(key, key).strip():
            raise ConfigError(f"{field}.{key}", options.get(key), "the answer word, e.g. " + key)


def check_judge_options(options: dict, field: str) -> None:
    if not isinstance(options.get("with_source", False), bool):
        raise ConfigError(f"{field}.with_source", options.get("with_source"), "true (the judge sees each edit's source "
                          "before the edit: an instruction-following judge for edit families) or false")
    _check_options(options, field, DEFAULT_EDIT_TEMPLATE if options.get("with_source") else DEFAULT_TEMPLATE, "prompt")


def check_answer_judge_options(options: dict, field: str) -> None:
    _check_options(options, field, DEFAULT_ANSWER_TEMPLATE, "answer")


def _single_token(judge, word: str, path: str) -> int:
    ids = judge.tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ModelFolderError(f"model folder `{path}`: the judge's tokenizer splits {word!r} into {len(ids)} tokens; "
                               "choose answer words (options yes / no) that are single tokens for this model")
    if ids[0] == judge.tokenizer.unk_token_id:
        raise ModelFolderError(f"model folder `{path}`: {word!r} is not in the judge's vocabulary (it reads as the "
                               "unknown token); choose answer words (options yes / no) the model knows")
    return ids[0]


class _Judge:
    """A frozen local VLM's P(yes) for (image, question) pairs; loaded on first use, where it
    scores (a reward worker or the VLM trainer's actor), once."""

    def __init__(self, path: str, yes: str, no: str, two_way: bool, batch_size: int):
        self.path, self.words, self.two_way, self.batch_size = path, (yes, no), two_way, batch_size
        self.model = self.ids = None

    @torch.no_grad()
    def p_yes(self, images: list, questions: list[str]) -> torch.Tensor:
        """P(yes) per (image, question); an image may be a tuple of pictures shown in order."""
        if self.model is None:
            from pixelrl.models.qwen_vl.model import QwenVLModel

            self.model = QwenVLModel(self.path, device=scoring_device())
            self.model.model.requires_grad_(False)
            self.ids = [_single_token(self.model, word, self.path) for word in self.words]
        yes_id, no_id = self.ids
        scores = []
        for start in range(0, len(images), self.batch_size):
            batch = self.model.prompts(images[start:start + self.batch_size], questions[start:start + self.batch_size])
            logp = self.model.next_token_logprobs(batch)
            if self.two_way:
                scores.append(torch.softmax(logp[:, [yes_id, no_id]], -1)[:, 0])
            else:
                scores.append(logp[:, yes_id].exp())
        return torch.cat(scores).cpu()


def item_images(metadata: list[dict], image_key: str, reward: str) -> list[np.ndarray]:
    """The picture each vision-language item carries, for rewards that judge answers about it."""
    if any(image_key not in m for m in metadata):
        raise RewardError(f"{reward}: an item has no `{image_key}` (option image_key); it scores answers of the "
                          "vision-language trainer, whose items carry their image")
    return [np.asarray(m[image_key], dtype=np.uint8) for m in metadata]


@register_reward("vlm_judge")
def vlm_judge(path: str = "", template: str | None = None, yes: str = "yes", no: str = "no",
              two_way: bool = True, batch_size: int = 16, with_source: bool = False):
    """P(yes) of a local VLM asked `template` about each image; `with_source`: shown each row's
    source picture(s) first and the edit last, asked whether the edit follows the instruction
    (an edit family's instruction-following judge)."""
    template = template if template is not None else DEFAULT_EDIT_TEMPLATE if with_source else DEFAULT_TEMPLATE
    check_judge_options({"path": path, "template": template, "yes": yes, "no": no, "batch_size": batch_size,
                         "with_source": with_source}, "reward.functions[].options")
    judge = _Judge(path, yes, no, two_way, batch_size)

    def reward(images, prompts, metadata, condition_images=None):
        arrays = list(np.asarray(images.detach().cpu().numpy(), dtype=np.uint8))
        if with_source:  # each item: the row's sources, then its edit
            arrays = [(*(np.asarray(s.cpu().numpy(), dtype=np.uint8) for s in row), edit)
                      for row, edit in zip(condition_images, arrays)]
        return {"vlm_judge": judge.p_yes(arrays, [fill(template, {"prompt": p}) for p in prompts])}

    reward.reads_condition_images = with_source
    return reward


vlm_judge.check_options = check_judge_options
# the start-up check asks this of the config's options (a text-to-image run has no sources to show)
vlm_judge.reads_condition_images = lambda options: bool(options.get("with_source", False))


@register_reward("answer_judge")
def answer_judge(path: str = "", template: str = DEFAULT_ANSWER_TEMPLATE, yes: str = "yes", no: str = "no",
                 two_way: bool = True, batch_size: int = 16, image_key: str = "image"):
    """(vision-language trainer) A reward model for answers: P(yes) of a local VLM shown the
    question's image and asked whether the policy's answer to the question is correct."""
    check_answer_judge_options({"path": path, "template": template, "yes": yes, "no": no,
                                "batch_size": batch_size}, "reward.functions[].options")
    judge = _Judge(path, yes, no, two_way, batch_size)

    def reward(responses, questions, metadata):
        images = item_images(metadata, image_key, "answer_judge")
        asked = [fill(template, {"question": q, "answer": r.strip()}) for q, r in zip(questions, responses)]
        return {"answer_judge": judge.p_yes(images, asked)}

    return reward


answer_judge.check_options = check_answer_judge_options
