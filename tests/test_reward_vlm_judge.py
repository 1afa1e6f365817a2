"""The VLM judge on a tiny random Qwen2-VL: its P(yes) equals the probability the VLM trainer's
own scoring path gives the one-word answers, batching does not change it, bad options are named."""

import numpy as np
import pytest
import torch

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.models.qwen_vl.model import QwenVLModel
from pixelrl.rewards import get_reward

PROMPTS = ["a red circle", "two blue squares", "a green star"]
TEMPLATE = "is there {prompt} ?"


def images(batch=3, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8))


def test_judge_probability_equals_the_answer_probability_of_the_policy_scoring_path(any_tiny_vlm_path):
    """A Qwen2-VL judge, then a Qwen2.5-VL one."""
    batch = images()
    judge = get_reward("vlm_judge", path=str(any_tiny_vlm_path), template=TEMPLATE)
    two_way = judge(batch, PROMPTS, [{}] * 3)["vlm_judge"]
    full = get_reward("vlm_judge", path=str(any_tiny_vlm_path), template=TEMPLATE, two_way=False, batch_size=1)(
        batch, PROMPTS, [{}] * 3)["vlm_judge"]

    model = QwenVLModel(any_tiny_vlm_path)
    questions = [TEMPLATE.replace("{prompt}", p) for p in PROMPTS]
    prompts = model.prompts(list(batch.numpy()), questions)
    with torch.no_grad():
        p_yes = model.token_logprobs(model.with_responses(prompts, ["yes"] * 3))[:, 0].exp()
        p_no = model.token_logprobs(model.with_responses(prompts, ["no"] * 3))[:, 0].exp()
    torch.testing.assert_close(full, p_yes, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(two_way, p_yes / (p_yes + p_no), rtol=1e-4, atol=1e-6)
    assert ((two_way > 0) & (two_way < 1)).all()


def test_judge_is_independent_of_batching_and_reads_the_prompt(tiny_vlm_path):
    batch = images(seed=1)
    whole = get_reward("vlm_judge", path=str(tiny_vlm_path), template=TEMPLATE)(batch, PROMPTS, [{}] * 3)["vlm_judge"]
    single = get_reward("vlm_judge", path=str(tiny_vlm_path), template=TEMPLATE, batch_size=1)(
        batch, PROMPTS, [{}] * 3)["vlm_judge"]
    torch.testing.assert_close(single, whole, rtol=1e-4, atol=1e-6)
    other = get_reward("vlm_judge", path=str(tiny_vlm_path), template=TEMPLATE)(
        batch, ["a purple triangle"] * 3, [{}] * 3)["vlm_judge"]
    assert not torch.allclose(other, whole)


def test_judge_options_are_checked(tmp_path, tiny_vlm_path):
    with pytest.raises(ConfigError, match="options.path"):
        get_reward("vlm_judge", path=str(tmp_path))
    with pytest.raises(ConfigError, match="options.template"):
        get_reward("vlm_judge", path=str(tiny_vlm_path), template="no placeholder")
    with pytest.raises(ModelFolderError, match="'absolutely' is not in the judge's vocabulary"):
        get_reward("vlm_judge", path=str(tiny_vlm_path), yes="absolutely")(images(1), ["x"], [{}])


QUESTIONS = ["what colour is the shape?", "how many shapes are there?", "where is the circle?"]
ANSWER_TEMPLATE = "{question} the answer is {answer} . correct ?"


def test_answer_judge_is_the_judges_yes_probability_for_question_and_answer(tiny_vlm_path):
    """A reward model for the VLM trainer: the image comes from the item, the question and the
    policy's answer fill the template in one pass (an answer holding `{question}` stays literal)."""
    batch = list(images(seed=2).numpy())
    answers = ["red", "two", "{question}"]
    judge = get_reward("answer_judge", path=str(tiny_vlm_path), template=ANSWER_TEMPLATE)
    scores = judge(answers, QUESTIONS, [{"image": im} for im in batch])["answer_judge"]

    model = QwenVLModel(tiny_vlm_path)
    asked = [f"{q} the answer is {a} . correct ?" for q, a in zip(QUESTIONS, answers)]
    prompts = model.prompts(batch, asked)
    with torch.no_grad():
        p_yes = model.token_logprobs(model.with_responses(prompts, ["yes"] * 3))[:, 0].exp()
        p_no = model.token_logprobs(model.with_responses(prompts, ["no"] * 3))[:, 0].exp()
    torch.testing.assert_close(scores, p_yes / (p_yes + p_no), rtol=1e-4, atol=1e-6)
    other = judge(["blue", "five", "left"], QUESTIONS, [{"image": im} for im in batch])["answer_judge"]
    assert not torch.allclose(other, scores)  # the answer is read
    with pytest.raises(Exception, match="no `image`"):
        judge(answers, QUESTIONS, [{}] * 3)
    with pytest.raises(ConfigError, match="options.template"):
        get_reward("answer_judge", path=str(tiny_vlm_path), template="is {question} right?")


def test_the_vlm_trainer_trains_on_the_answer_judge(tiny_vlm_path, tmp_path):
    """The judge (here the tiny VLM itself) scores the sampled answers inside the trainer: the
    logged reward is the judge's score of exactly those answers."""
    from conftest import experience_with_reward_inputs, vlm_config

    cfg = vlm_config(tiny_vlm_path, tmp_path, f"reward.functions=[{{name: answer_judge, options: {{path: "
                                              f"'{tiny_vlm_path}', template: '{ANSWER_TEMPLATE}'}}}}]")
    judge = get_reward("answer_judge", path=str(tiny_vlm_path), template=ANSWER_TEMPLATE)
    engine, exp, metrics, captured = experience_with_reward_inputs(cfg)
    expected = judge(captured["texts"], captured["questions"], captured["meta"])["answer_judge"]
    assert metrics["critic/rewards/answer_judge/mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert 0 < metrics["critic/rewards/answer_judge/mean"] < 1
    train_metrics = engine.train_on(exp, 1)
    assert train_metrics  # an update on the judge's rewards
