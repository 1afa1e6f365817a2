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


def images(batch=3, seed=0, size=32):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))


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


def test_an_edit_judge_sees_the_source_then_the_edit(tiny_vlm_path):
    """with_source: one prompt per row holding its source, then its edit (two vision blocks, each
    with its own picture's image tokens, in that order); the score is the scoring path's two-way
    P(yes) for that prompt, depends on the source, is the same alone and in a batch, and the
    start-up check sees a judge with the option as a reward that reads sources."""
    from pixelrl.rewards.vlm_judge import vlm_judge

    edits, sources = images(seed=3), [(s,) for s in images(seed=4, size=16)]
    judge = get_reward("vlm_judge", path=str(tiny_vlm_path), template=TEMPLATE, with_source=True)
    assert judge.reads_condition_images and vlm_judge.reads_condition_images({"with_source": True})
    scores = judge(edits, PROMPTS, [{}] * 3, condition_images=sources)["vlm_judge"]

    model = QwenVLModel(tiny_vlm_path)
    questions = [TEMPLATE.replace("{prompt}", p) for p in PROMPTS]
    pairs = [(source.numpy(), edit) for (source,), edit in zip(sources, edits.numpy())]
    prompts = model.prompts(pairs, questions)
    # row 0's prompt: a vision block per picture, as many image tokens as its grid's merged patches,
    # and the pixels in the same order (source, then edit)
    from PIL import Image

    config, merge = model.model.config, model.image_processor.merge_size ** 2
    alone = [model.image_processor([Image.fromarray(picture)], return_tensors="pt") for picture in pairs[0]]
    ids = prompts.input_ids[0].tolist()
    blocks = [ids[i + 1:ids.index(config.vision_end_token_id, i)] for i, t in enumerate(ids)
              if t == config.vision_start_token_id]
    assert [len(b) for b in blocks] == [int(v["image_grid_thw"].prod()) // merge for v in alone]
    assert all(set(b) == {config.image_token_id} for b in blocks)
    first = torch.cat([v["pixel_values"] for v in alone]).to(prompts.pixel_values.dtype)
    assert torch.equal(prompts.pixel_values[:len(first)], first)
    with torch.no_grad():
        p_yes = model.token_logprobs(model.with_responses(prompts, ["yes"] * 3))[:, 0].exp()
        p_no = model.token_logprobs(model.with_responses(prompts, ["no"] * 3))[:, 0].exp()
    torch.testing.assert_close(scores, p_yes / (p_yes + p_no), rtol=1e-4, atol=1e-6)
    alone = get_reward("vlm_judge", path=str(tiny_vlm_path), template=TEMPLATE, with_source=True, batch_size=1)(
        edits, PROMPTS, [{}] * 3, condition_images=sources)["vlm_judge"]
    torch.testing.assert_close(alone, scores, rtol=1e-4, atol=1e-6)
    other = judge(edits, PROMPTS, [{}] * 3, condition_images=[(s,) for s in images(seed=5, size=16)])["vlm_judge"]
    assert not torch.allclose(other, scores)
    with pytest.raises(ConfigError, match="with_source"):
        get_reward("vlm_judge", path=str(tiny_vlm_path), with_source="yes")


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
