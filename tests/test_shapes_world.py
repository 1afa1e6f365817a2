"""The procedural shapes world: renderer, prompt sets and the GenEval-style detector."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from pixelrl.data.shapes import all_prompts, evaluation_items, prompt_splits, render, vocabulary
from pixelrl.rewards import get_reward
from pixelrl.rewards.shapes import CATEGORIES, detect, score_image

ITEMS = [item for items in all_prompts().values() for item in items]


def test_renderer_is_deterministic_per_seed():
    spec = all_prompts()["color_attr"][5]["metadata"]
    assert np.array_equal(render(spec, 123), render(spec, 123))
    assert not np.array_equal(render(spec, 123), render(spec, 124))
    image = render(spec, 123)
    assert image.dtype == np.uint8 and image.shape == (32, 32, 3)


def test_prompt_categories_and_splits():
    prompts = all_prompts()
    assert set(prompts) == set(CATEGORIES)
    assert prompts["position"][0]["prompt"] == "a circle to the left of a square"
    assert any(p["prompt"] == "three red circles" for p in prompts["counting"])
    assert any(p["prompt"] == "a red square and a green circle" for p in prompts["color_attr"])
    splits = prompt_splits()
    train = {p["prompt"] for p in splits["train"]}
    test = {p["prompt"] for p in splits["test"]}
    # large categories hold their test prompts out of training; tiny ones are shared
    for item in splits["test"]:
        if item["category"] in ("counting", "colors", "position", "color_attr"):
            assert item["prompt"] not in train
    assert {p["prompt"] for p in prompts["single_object"]} <= train & test
    assert prompt_splits() == splits  # fixed


def test_evaluation_items_cover_every_category_with_distinct_seeds():
    items = evaluation_items("test", per_category=64)
    assert len(items) == 384
    assert {it["category"] for it in items} == set(CATEGORIES)
    assert len({it["seed"] for it in items}) == 384
    assert all(word in vocabulary() for it in items for word in it["prompt"].split())


def _strict_accuracy(images_and_specs):
    return np.mean([score_image(img, spec)[1] for img, spec in images_and_specs])


def test_detector_strict_accuracy_on_clean_renders_is_at_least_99_percent():
    pairs = [(render(it["metadata"], k), it["metadata"]) for k, it in
             ((k, ITEMS[(k * 7) % len(ITEMS)]) for k in range(600))]
    assert _strict_accuracy(pairs) >= 0.99


@pytest.mark.parametrize("noise, blur", [(6.0, 0.0), (0.0, 0.6), (6.0, 0.5)])
def test_detector_is_stable_under_mild_noise_and_blur(noise, blur):
    pairs = []
    for k in range(300):
        item = ITEMS[(k * 11) % len(ITEMS)]
        image = Image.fromarray(render(item["metadata"], k))
        if blur:
            image = image.filter(ImageFilter.GaussianBlur(blur))
        array = np.asarray(image).astype(np.float32) + np.random.default_rng(k).normal(0, noise, (32, 32, 3))
        pairs.append((np.clip(array, 0, 255).round().astype(np.uint8), item["metadata"]))
    assert _strict_accuracy(pairs) >= 0.97


def test_detector_reads_shape_colour_and_position():
    spec = {"category": "position", "relation": {"type": "left_of", "a": 0, "b": 1},
            "objects": [{"shape": "triangle", "colour": "red", "count": 1},
                        {"shape": "square", "colour": "blue", "count": 1}]}
    image = render(spec, 3)
    found = sorted(detect(image), key=lambda d: d.cx)
    assert [(d.shape, d.colour) for d in found] == [("triangle", "red"), ("square", "blue")]
    # mirrored image: the relation fails, counts and colours still hold
    partial, strict, subs = score_image(image[:, ::-1].copy(), spec)
    assert not strict and subs["position"] == 0.0 and subs["count_0"] == 1.0
    assert partial == pytest.approx(4 / 5)


def test_partial_credit_for_counts_and_a_black_image():
    spec = {"category": "counting", "relation": None, "objects": [{"shape": "circle", "colour": "green", "count": 4}]}
    three = {"category": "counting", "relation": None, "objects": [{"shape": "circle", "colour": "green", "count": 3}]}
    partial, strict, _ = score_image(render(three, 1), spec)
    assert partial == pytest.approx(1 - 1 / 4) and not strict
    partial, strict, _ = score_image(np.zeros((32, 32, 3), np.uint8), spec)
    assert partial == 0.0 and not strict


def test_shapes_geneval_reward_signature():
    items = all_prompts()["colors"][:3]
    images = torch.stack([torch.from_numpy(render(it["metadata"], 0)) for it in items])
    out = get_reward("shapes_geneval", strict_weight=0.5)(images, [it["prompt"] for it in items],
                                                          [it["metadata"] for it in items])
    assert torch.equal(out["shapes_strict"], torch.ones(3)) and torch.equal(out["shapes_geneval"], torch.ones(3))
