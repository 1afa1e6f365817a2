"""The procedural shapes world: renderer, prompt sets and the GenEval-style detector."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from pixelrl.shapes.world import all_prompts, evaluation_items, prompt_splits, render, vocabulary
from pixelrl.rewards import get_reward
from pixelrl.shapes.detector import CATEGORIES, detect, score_image
from conftest import with_extra_object

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


def test_ideal_shape_coverage_by_hand():
    """The ideal shapes the detector matches components against, counted at 4 x 4 sub-pixels: a
    square whose edges fall on sub-pixel boundaries covers exactly its area, a pixel its left edge
    halves and its top edge leaves a quarter of covers 0.5 x 0.75; a disc and a triangle cover
    their areas to within the sampling."""
    from pixelrl.shapes.detector import ideal_coverages

    ideal = ideal_coverages(4.5, 8.25, 10.0, 6.0, 32)
    assert ideal["square"].sum() == 60.0
    assert ideal["square"][8, 4] == 0.5 * 0.75 and ideal["square"][10, 10] == 1.0 and ideal["square"][7, 4] == 0.0
    assert ideal["circle"].sum() == pytest.approx(np.pi * 60 / 4, rel=0.02)
    assert ideal["triangle"].sum() == pytest.approx(30.0, rel=0.03)
    assert ideal["triangle"][8, 9] > 0 and ideal["triangle"][8, 5] == 0.0  # the apex is at the top centre
    assert all(c.min() >= 0 and c.max() <= 1 for c in ideal.values())


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


def test_exact_scene_score_on_clean_renders_and_with_an_unrequested_object():
    from pixelrl.shapes.detector import score_scene

    clean = [score_scene(render(it["metadata"], k), it["metadata"])
             for k, it in ((k, ITEMS[(k * 7) % len(ITEMS)]) for k in range(300))]
    assert all(s["exact"] and s["extra_objects"] == 0 for s in clean if s["strict"])
    assert np.mean([s["exact"] for s in clean]) >= 0.99
    pasted_strict, pasted_exact = [], []
    for k in range(60):
        item = ITEMS[(k * 11) % len(ITEMS)]
        if item["category"] == "counting":
            continue  # a pasted copy would change the count: strict fails too; see below
        image = render(with_extra_object(item["metadata"], "triangle", "purple"), k)
        scene = score_scene(image, item["metadata"])
        pasted_strict.append(scene["strict"])
        pasted_exact.append(scene["exact"])
        assert not scene["exact"] and scene["extra_objects"] >= 1, item["prompt"]
    # GenEval-style "at least" checks still pass nearly all of these scenes: that is the hack
    assert np.mean(pasted_strict) >= 0.8 and not any(pasted_exact)


def test_extra_object_penalty_by_hand():
    """two_object "a circle and a square", strict_weight 0.5, penalty 0.2: a clean render scores
    0.5 * 1 + 0.5 * 1 = 1.0; with one unrequested triangle 1.0 - 0.2 = 0.8; with two 0.6; with an
    unrequested second circle (a surplus copy) 0.8 as well."""
    spec = {"category": "two_object", "relation": None,
            "objects": [{"shape": "circle", "colour": None, "count": 1}, {"shape": "square", "colour": None, "count": 1}]}
    images = [render(spec, 5), render(with_extra_object(spec, "triangle", "cyan"), 5),
              render(with_extra_object(spec, "triangle", "cyan", 2), 5), render(with_extra_object(spec, "circle", "yellow"), 5)]
    reward = get_reward("shapes_geneval", strict_weight=0.5, extra_object_penalty=0.2)
    out = reward(torch.from_numpy(np.stack(images)), ["a circle and a square"] * 4, [spec] * 4)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.0, 0.8, 0.6, 0.8]))
    assert out["shapes_extra_objects"].tolist() == [0, 1, 2, 1]
    assert out["shapes_exact"].tolist() == [1, 0, 0, 0] and out["shapes_strict"].tolist() == [1, 1, 1, 1]


def test_surplus_penalty_charges_objects_beyond_the_count_not_failed_attempts():
    """"a circle and a square", strict 0.25, exact 0.5 (partial 0.25), penalty q = 0.2 per surplus
    object: a clean render scores 1.0; one unrequested triangle added (3 objects for 2 asked) 0.25 +
    0.25 - 0.2 = 0.3; a triangle drawn instead of the square (2 objects, partial 1/2) 0.25 * 0.5 =
    0.125, the same as leaving the square out. The per-unrequested-object penalty p = 0.2 charges that
    failed attempt (0.125 - 0.2 = -0.075), so it pays less than the omission."""
    spec = {"category": "two_object", "relation": None,
            "objects": [{"shape": "circle", "colour": None, "count": 1}, {"shape": "square", "colour": None, "count": 1}]}
    circle_only = {**spec, "objects": spec["objects"][:1]}
    triangle_instead = {**spec, "objects": [spec["objects"][0], {"shape": "triangle", "colour": None, "count": 1}]}
    images = torch.from_numpy(np.stack([render(spec, 5), render(with_extra_object(spec, "triangle", "cyan"), 5),
                                        render(triangle_instead, 5), render(circle_only, 5)]))
    weights = dict(strict_weight=0.25, exact_weight=0.5)
    out = get_reward("shapes_geneval", **weights, surplus_object_penalty=0.2)(images, [""] * 4, [spec] * 4)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.0, 0.3, 0.125, 0.125]))
    assert out["shapes_surplus_objects"].tolist() == [0, 1, 0, 0]
    assert out["shapes_extra_objects"].tolist() == [0, 1, 1, 0]
    out = get_reward("shapes_geneval", **weights, extra_object_penalty=0.2)(images, [""] * 4, [spec] * 4)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.0, 0.3, -0.075, 0.125]))
    # object_count_weight k = 0.25 adds k * (1 - |n - 2| / 2): 1.25; 0.3 + 0.125 = 0.425 (three
    # objects); 0.125 + 0.25 = 0.375 (the failed attempt); 0.125 + 0.125 = 0.25 (the omission)
    out = get_reward("shapes_geneval", **weights, surplus_object_penalty=0.2, object_count_weight=0.25)(
        images, [""] * 4, [spec] * 4)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.25, 0.425, 0.375, 0.25]))


def test_failure_modes_of_rendered_scenes():
    """Each failure mode on a render made to have it, scored against "a circle and a square" (and
    "a circle to the left of a square"), and their per-category fractions in `geneval_scores`."""
    from pixelrl.shapes.evaluate import format_failures, geneval_scores
    from pixelrl.shapes.detector import score_scene

    circle, square = {"shape": "circle", "colour": None, "count": 1}, {"shape": "square", "colour": None, "count": 1}
    triangle = {"shape": "triangle", "colour": None, "count": 1}
    two = {"category": "two_object", "relation": None, "objects": [circle, square]}
    drawn = {
        "exact": two,
        "extra": with_extra_object(two, "triangle", "cyan"),
        "too_few": {**two, "objects": [circle]},
        "too_many": {**two, "objects": [circle, {**triangle, "count": 2}]},
        "repeated_shape": {**two, "objects": [{**circle, "count": 2}]},
        "wrong_object": {**two, "objects": [circle, triangle]},
    }
    for mode, spec in drawn.items():
        assert score_scene(render(spec, 5), two)["failure"] == mode, mode
    left_of = {"category": "position", "objects": [circle, square], "relation": {"type": "left_of", "a": 0, "b": 1}}
    right_of = {**left_of, "relation": {"type": "right_of", "a": 0, "b": 1}}
    assert score_scene(render(right_of, 5), left_of)["failure"] == "relation"
    assert score_scene(render(left_of, 5), left_of)["failure"] == "exact"

    images = torch.from_numpy(np.stack([render(drawn[m], 5) for m in ("exact", "too_few", "too_few", "repeated_shape")]))
    result = geneval_scores(images, [{"prompt": "a circle and a square", "seed": k, "category": "two_object",
                                      "metadata": two} for k in range(4)])
    assert result["failures"]["two_object"] == {"exact": 0.25, "extra": 0.0, "too_few": 0.5, "too_many": 0.0,
                                                "repeated_shape": 0.25, "wrong_object": 0.0, "relation": 0.0}
    assert "| two_object | 0.25 -> 0.25 | 0.00 -> 0.00 | 0.50 -> 0.50 |" in format_failures(result, result)


def test_exact_weight_pays_full_marks_only_for_a_scene_with_nothing_extra():
    """"a circle and a square", exact_weight 0.5, penalty 0.1, strict_weight 0: a clean render
    scores 0.5 * 1 + 0.5 * 1 = 1.0; one unrequested triangle 0.5 * 1 + 0.5 * 0 - 0.1 = 0.4 (the
    "at least" partial credit is still full); two 0.3; the square missing (partial credit 1/2)
    0.25. With strict_weight 0.25 as well, the clean render still scores 1.0 and the one-triangle
    scene 0.25 * 1 + 0.25 * 1 + 0 - 0.1 = 0.4."""
    spec = {"category": "two_object", "relation": None,
            "objects": [{"shape": "circle", "colour": None, "count": 1}, {"shape": "square", "colour": None, "count": 1}]}
    circle_only = {**spec, "objects": spec["objects"][:1]}
    images = torch.from_numpy(np.stack([render(spec, 5), render(with_extra_object(spec, "triangle", "cyan"), 5),
                                        render(with_extra_object(spec, "triangle", "cyan", 2), 5), render(circle_only, 5)]))
    out = get_reward("shapes_geneval", exact_weight=0.5, extra_object_penalty=0.1)(images, [""] * 4, [spec] * 4)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.0, 0.4, 0.3, 0.25]))
    out = get_reward("shapes_geneval", strict_weight=0.25, exact_weight=0.5, extra_object_penalty=0.1)(
        images[:2], [""] * 2, [spec] * 2)
    torch.testing.assert_close(out["shapes_geneval"], torch.tensor([1.0, 0.4]))


def test_shapes_reward_options_are_checked_with_the_config():
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    for options, field in (("{extra_object_penalty: -1}", "extra_object_penalty"),
                           ("{surplus_object_penalty: -0.5}", "surplus_object_penalty"),
                           ("{object_count_weight: -1}", "object_count_weight"),
                           ("{strict_weight: 2}", "strict_weight"),
                           ("{strict_weight: 0.6, exact_weight: 0.5}", r"exact_weight.*\[0, 0\.4\]")):
        with pytest.raises(ConfigError, match=field):
            load_config("shapes_flow_grpo", [f"reward.functions=[{{name: shapes_geneval, options: {options}}}]"])
    with pytest.raises(ConfigError, match=r"val_kwargs\.rewards\[0\]\.name"):
        load_config("shapes_flow_grpo", ["val_kwargs.rewards=[{name: nope}]"])


def test_bootstrap_interval_by_hand():
    from pixelrl.shapes.evaluate import bootstrap_overall

    def rows(category_values):
        return [{"prompt": f"{c}{i}", "seed": i, "category": c, "strict": v}
                for c, values in category_values.items() for i, v in enumerate(values)]

    # one category of two items (0, 1): resampled means are 0, 0.5, 1 with chances 1/4, 1/2, 1/4
    assert bootstrap_overall(rows({"a": [0, 1]}), "strict") == (0.0, 1.0)
    # constant scores have no spread; the overall is the mean of category means (0.5 here)
    assert bootstrap_overall(rows({"a": [1, 1, 1], "b": [0, 0]}), "strict") == (0.5, 0.5)
    # paired: the interval of after - before, item by item
    before, after = rows({"a": [0, 0, 0, 0]}), rows({"a": [1, 1, 1, 1]})
    assert bootstrap_overall(after, "strict", baseline=before) == (1.0, 1.0)
    with pytest.raises(ValueError, match="same items"):
        bootstrap_overall(after, "strict", baseline=before[::-1])


# --------------------------------------------------------------------- the careful judge
RED_SQUARE = {"category": "colors", "objects": [{"shape": "square", "colour": "red", "count": 1}], "relation": None}
SQUARE_AND_CIRCLE = {"category": "two_object", "relation": None,
                     "objects": [{"shape": "square", "colour": None, "count": 1},
                                 {"shape": "circle", "colour": None, "count": 1}]}


def test_the_careful_judge_passes_every_clean_render():
    from pixelrl.shapes.careful import careful_verdict

    verdicts = [careful_verdict(render(it["metadata"], k), it["metadata"])
                for k, it in ((k, ITEMS[(k * 7) % len(ITEMS)]) for k in range(300))]
    assert all(ok for ok, _ in verdicts), [why for ok, why in verdicts if not ok]


def test_the_careful_judge_rejects_what_the_strict_verdict_lets_through():
    """Each flaw, put into a clean render: the strict (GenEval-style) verdict still passes the
    image, the careful judge fails it and names the flaw."""
    import colorsys

    from pixelrl.shapes.careful import careful_verdict
    from pixelrl.shapes.detector import score_scene
    from pixelrl.shapes.world import Placed, draw

    square = draw([Placed("square", "red", 10, 10, 10)])
    assert careful_verdict(square, RED_SQUARE) == (True, "clean")
    notched = square.copy()
    notched[10:16, 10:16] = 0  # a 6 x 6 corner bitten out of a 10 x 10 square: IoU 0.64
    orange = square.copy()
    lit = square.max(axis=-1) > 0
    hue_20 = np.array(colorsys.hsv_to_rgb(20 / 360, 0.86, 1.0))  # 20 degrees from the palette's red
    orange[lit] = (hue_20 * square[lit].max(axis=-1, keepdims=True)).astype(np.uint8)
    grey_specks = square.copy()
    for y, x in ((2, 2), (2, 28), (28, 2), (28, 28), (5, 25)):
        grey_specks[y, x] = 128
    flawed = [
        (notched, RED_SQUARE, "misshapen"),
        (orange, RED_SQUARE, "off-palette colour"),
        (draw([Placed("square", "red", -3, 10, 10)]), RED_SQUARE, "cut at the border"),
        (grey_specks, RED_SQUARE, "stray pixels"),
        (draw([Placed("square", "red", 4, 10, 10), Placed("circle", "blue", 14, 10, 10)]), SQUARE_AND_CIRCLE,
         "two colours touching"),
        (render(with_extra_object(RED_SQUARE, "triangle", "purple"), 3), RED_SQUARE, "unrequested object"),
    ]
    for image, spec, reason in flawed:
        assert score_scene(image, spec)["strict"], reason
        assert careful_verdict(image, spec) == (False, reason)
    # and a scene the strict verdict fails, it fails too
    assert careful_verdict(square, SQUARE_AND_CIRCLE) == (False, "scene")


def test_evaluation_reports_the_careful_judge_and_its_agreement():
    from pixelrl.shapes.evaluate import format_careful, geneval_scores

    items = [dict(ITEMS[k], seed=k) for k in range(12)]
    clean = torch.stack([torch.from_numpy(render(it["metadata"], k)) for k, it in enumerate(items)])
    grey = clean.clone()
    grey[:6, 0:3, 0:3] = 128  # nine grey pixels in a corner of half the images
    clean_scores, grey_scores = geneval_scores(clean, items), geneval_scores(grey, items)
    assert clean_scores["overall_careful"] == 1.0 and clean_scores["agreement"] == 1.0
    assert grey_scores["agreement"] == 0.5 and grey_scores["careful_rejects"]["stray pixels"] == 0.5
    line = format_careful(grey_scores, baseline=clean_scores)
    assert "agrees with the strict verdict on 100.0% -> 50.0%" in line and "stray pixels 50.0%" in line


def test_background_penalty_charges_grain_the_detector_does_not_see():
    """A clean render and the same render with a dim grain of level 10 on every 4th background
    pixel (below the detector's threshold: the scene still scores 1): with b = 2 the grainy one
    loses 2 x (its background level) / 255, the clean one nothing."""
    from pixelrl.shapes.detector import background_noise

    item = all_prompts()["colors"][0]
    clean = torch.from_numpy(render(item["metadata"], 0))
    grainy = clean.clone()
    dark = grainy.amax(dim=-1) < 48
    speckle = dark & (torch.arange(dark.numel()).reshape(dark.shape) % 4 == 0)
    grainy[speckle] = 10
    images = torch.stack([clean, grainy])
    plain = get_reward("shapes_geneval")(images, [item["prompt"]] * 2, [item["metadata"]] * 2)["shapes_geneval"]
    charged = get_reward("shapes_geneval", background_penalty=2.0)(images, [item["prompt"]] * 2,
                                                                   [item["metadata"]] * 2)["shapes_geneval"]
    level = background_noise(grainy[None])["background_level"]
    assert plain.tolist() == [1.0, 1.0] and 2.0 < level < 3.0
    torch.testing.assert_close(charged, torch.tensor([1.0 - 2 * background_noise(clean[None])["background_level"] / 255,
                                                      1.0 - 2 * level / 255]))
    assert charged[1] < charged[0]
