"""The scalar-head reward model for the VLM trainer on a tiny random Qwen2-VL: the head reads the
final hidden state at the answer's end-of-sequence token whatever the padding, normalisation by
hand, heads saved inside the weights (OpenRLHF / LightRFT style) or beside them, and the reward
inside the trainer."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.rewards import get_reward

QUESTIONS = ["how many red circles are there ?", "what colour is the square ?", "is the triangle left of the circle ?"]


def _images(batch=3, seed=0):
    return [np.random.default_rng(seed + i).integers(0, 256, (32, 32, 3), dtype=np.uint8) for i in range(batch)]


def _with_head(src, dst, weight, bias, *, inside=False, prefix="value_head", config=None):
    shutil.copytree(src, dst)
    head = {f"{prefix}.weight": weight.reshape(1, -1).contiguous(), f"{prefix}.bias": torch.tensor([float(bias)])}
    if inside:  # a reward model saved whole: the head's tensors next to the backbone's
        weights = load_file(str(dst / "model.safetensors"))
        save_file({**weights, **head}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        save_file(head, str(dst / "value_head.safetensors"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _score(path, answers, images=None, questions=None, **options):
    images = images or _images(len(answers))
    questions = questions or (QUESTIONS * 3)[:len(answers)]
    meta = [{"image": im} for im in images]
    return get_reward("answer_reward_model", path=str(path), **options)(answers, questions, meta)["answer_reward_model"]


def _hidden_size(path):
    return json.loads((path / "config.json").read_text())["text_config"]["hidden_size"]


def test_a_bias_only_head_scores_its_bias_normalised_by_hand(tiny_vlm_path, tmp_path):
    zero = torch.zeros(_hidden_size(tiny_vlm_path))
    plain = _with_head(tiny_vlm_path, tmp_path / "plain", zero, 1.5)
    torch.testing.assert_close(_score(plain, ["two", "red", "yes"]), torch.full((3,), 1.5))
    # options: (1.5 - 0.5) / 2 = 0.5
    torch.testing.assert_close(_score(plain, ["two", "red", "yes"], mean=0.5, std=2.0), torch.full((3,), 0.5))
    # OpenRLHF's normalize_reward statistics in config.json: (1.5 - 1.0) / 0.25 = 2.0
    normalised = _with_head(tiny_vlm_path, tmp_path / "norm", zero, 1.5, inside=True, prefix="score",
                            config={"normalize_reward": True, "mean": 1.0, "std": 0.25})
    torch.testing.assert_close(_score(normalised, ["two", "red", "yes"]), torch.full((3,), 2.0))
    # a head under another prefix (OpenRLHF's --value_head_prefix) is found when named
    other = _with_head(tiny_vlm_path, tmp_path / "other", zero, -0.5, inside=True, prefix="regression_head")
    torch.testing.assert_close(_score(other, ["two"], head_prefix="regression_head"), torch.full((1,), -0.5))


def test_the_score_is_read_at_the_answers_end_whatever_the_padding(tiny_vlm_path, tmp_path):
    """The same (image, question, answer) scores the same alone and in a batch where other rows
    have longer answers (right padding) and other questions (left padding); the answer moves it."""
    torch.manual_seed(0)
    folder = _with_head(tiny_vlm_path, tmp_path / "rm", torch.randn(_hidden_size(tiny_vlm_path)), 0.0, inside=True)
    images = _images(3, seed=4)
    alone = _score(folder, ["two"], images=images[:1], questions=QUESTIONS[:1])
    batched = _score(folder, ["two", "red red red red", "no no"], images=images, questions=QUESTIONS)
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-5)
    other = _score(folder, ["three"], images=images[:1], questions=QUESTIONS[:1])
    assert (other - alone).abs().item() > 1e-4
    split = _score(folder, ["two", "red red red red", "no no"], images=images, questions=QUESTIONS, batch_size=1)
    torch.testing.assert_close(split, batched, rtol=1e-5, atol=1e-5)


def test_folders_without_one_head_and_bad_options_are_named(tiny_vlm_path, tmp_path):
    with pytest.raises(ModelFolderError, match="no single value head"):
        _score(tiny_vlm_path, ["two"])
    zero = torch.zeros(_hidden_size(tiny_vlm_path))
    both = _with_head(tiny_vlm_path, tmp_path / "both", zero, 0.0, inside=True, prefix="score")
    save_file({"value_head.weight": zero.reshape(1, -1).contiguous()}, str(both / "value_head.safetensors"))
    with pytest.raises(ModelFolderError, match="no single value head"):
        _score(both, ["two"])
    with pytest.raises(ConfigError, match=r"options.std"):
        get_reward("answer_reward_model", path=str(tiny_vlm_path), std=0)
    with pytest.raises(ConfigError, match=r"options.path"):
        get_reward("answer_reward_model", path=str(tmp_path))


def test_the_vlm_trainer_trains_on_the_reward_model(tiny_vlm_path, tmp_path):
    from conftest import experience_with_reward_inputs, vlm_config

    torch.manual_seed(1)
    folder = _with_head(tiny_vlm_path, tmp_path / "rm", torch.randn(_hidden_size(tiny_vlm_path)), 0.1)
    cfg = vlm_config(tiny_vlm_path, tmp_path / "run",
                     f"reward.functions=[{{name: answer_reward_model, options: {{path: '{folder}'}}}}]")
    engine, exp, metrics, captured = experience_with_reward_inputs(cfg)
    expected = get_reward("answer_reward_model", path=str(folder))(captured["texts"], captured["questions"],
                                                                   captured["meta"])["answer_reward_model"]
    assert metrics["critic/rewards/answer_reward_model/mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert engine.train_on(exp, 1)
