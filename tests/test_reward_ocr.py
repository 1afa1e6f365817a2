"""The OCR reward: the formula by hand, then the real OCR engine on rendered text."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from pixelrl.core.errors import ConfigError, RewardError
from pixelrl.rewards import WeightedReward, get_reward
from pixelrl.rewards.ocr import quoted_target, text_similarity


@pytest.mark.parametrize("read, target, expected", [
    ("hello world", "hello", 1.0),            # the target inside the read text: distance 0
    ("Hello  World", "hello world", 1.0),     # case and whitespace do not count
    ("helo", "hello", 0.8),                   # one deletion: 1 - 1/5
    ("hxllo", "hello", 0.8),                  # one substitution
    ("abc", "abcdef", 0.5),                   # three missing of six
    ("", "cat", 0.0),                         # nothing read
    ("the quick brown fox", "cat", 0.0),      # distance 17, capped at len("cat")
    ("ca", "cat", 2 / 3),
])
def test_text_similarity_by_hand(read, target, expected):
    assert text_similarity(read, target) == pytest.approx(expected)


def test_target_is_the_first_quoted_text():
    assert quoted_target('a shop sign that says "Open Now", and "closed" below') == "Open Now"
    for prompt in ("a sign without quotes", 'an unclosed "quote', 'empty "" quotes'):
        with pytest.raises(RewardError, match="between double quotes"):
            quoted_target(prompt)


def render(word: str, size: int = 160) -> np.ndarray:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, size // 3), word, fill="black", font=ImageFont.load_default(size=size // 6))
    return np.array(image)


def test_ocr_reward_reads_rendered_text():
    reward = get_reward("ocr")
    prompts = ['a card with "pixelrl" on it', 'a card with "pixelrl" on it', 'a card with "pixelrl" on it',
               'a poster saying "hello world"']
    images = torch.from_numpy(np.stack([render("pixelrl"), render("pixlrl"), render(""), render("hello world")]))
    scores = reward(images, prompts, [{}] * 4)["ocr"]
    # exact, one letter missing (1 - 1/7), blank, two words (spaces ignored)
    assert scores.tolist() == pytest.approx([1.0, 1 - 1 / 7, 0.0, 1.0], abs=1e-6)


def test_ocr_reward_inside_weighted_reward_names_a_prompt_without_target():
    reward = WeightedReward.from_functions([{"name": "ocr"}])
    with pytest.raises(RewardError, match="no quotes"):
        reward(torch.from_numpy(render("x")[None]), ["no quotes"], [{}])


def test_ocr_options_checked_with_the_config():
    with pytest.raises(ConfigError, match="min_confidence"):
        get_reward("ocr", min_confidence=1.5)
    with pytest.raises(ConfigError, match="det_limit_side_len"):
        get_reward("ocr", det_limit_side_len=960.5)
    with pytest.raises(ConfigError, match="det_limit_type.*PaddleOCR"):
        get_reward("ocr", det_limit_type="both")


def test_ocr_detection_keeps_small_images_at_their_size_by_default(monkeypatch):
    """Detection limits the longer side to 960 (PaddleOCR's default): the engine is built with
    those options, and a 32 px render is read at its own size, exactly."""
    import rapidocr_onnxruntime

    from pixelrl.shapes import text as shapes_text

    built = []
    real = rapidocr_onnxruntime.RapidOCR

    def spy(**kwargs):
        built.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(rapidocr_onnxruntime, "RapidOCR", spy)
    reward = get_reward("ocr")
    words = ["sun", "owl", "zip", "key"]
    images = torch.from_numpy(np.stack([shapes_text.render(w, 3) for w in words]))
    scores = reward(images, [f'a sign that says "{w}"' for w in words], [{}] * 4)["ocr"]
    assert built[0]["det_limit_side_len"] == 960 and built[0]["det_limit_type"] == "max"
    assert scores.tolist() == [1.0] * 4
