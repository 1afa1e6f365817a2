import pytest
import torch

from pixelrl.core.errors import RewardError
from pixelrl.rewards import RewardSpec, WeightedReward, check_reward_output, get_reward, register_reward


def _images(smooth: bool, n: int = 2) -> torch.Tensor:
    if smooth:
        return torch.full((n, 32, 32, 3), 128, dtype=torch.uint8)
    return torch.randint(0, 256, (n, 32, 32, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def test_jpeg_rewards_order_flat_and_noisy_images():
    flat, noisy = _images(True), _images(False)
    comp = get_reward("jpeg_compressibility")
    incomp = get_reward("jpeg_incompressibility")
    assert (comp(flat, [], [])["jpeg_compressibility"] > comp(noisy, [], [])["jpeg_compressibility"]).all()
    sizes = incomp(noisy, [], [])["jpeg_incompressibility"]
    assert torch.allclose(comp(noisy, [], [])["jpeg_compressibility"], -sizes)
    # a 32x32 RGB noise image at quality 95 takes a few kB; a flat one well under one
    assert (sizes > 1.5).all() and (incomp(flat, [], [])["jpeg_incompressibility"] < 1.0).all()
    scaled = get_reward("jpeg_compressibility", scale=1 / 500)(noisy, [], [])["jpeg_compressibility"]
    assert torch.allclose(scaled, -sizes / 500)


def test_weighted_multi_reward():
    @register_reward("test_const")
    def const(value: float = 1.0):
        return lambda images, prompts, metadata: {"test_const": torch.full((images.shape[0],), value)}

    reward = WeightedReward([RewardSpec("test_const", 0.5, {"value": 2.0}),
                             RewardSpec("jpeg_incompressibility", 2.0)])
    out = reward(_images(False), ["p", "q"], [{}, {}])
    assert torch.allclose(out["overall"], 0.5 * 2.0 + 2.0 * out["jpeg_incompressibility"])
    assert set(out) == {"test_const", "jpeg_incompressibility", "overall"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1.0, 2.0], "returned a list .* torch.Tensor"),
        (torch.ones(3), r"shape \(3,\) .* expected \[2\]"),
        (torch.tensor([1.0, float("nan")]), r"non-finite .* positions \[1\]"),
        (torch.tensor([1.0, 1e30]), r"returned 1e\+30 .* overflow float32"),
    ],
)
def test_bad_reward_output_names_the_reward(bad, message):
    with pytest.raises(RewardError, match=f"reward `my_reward`.*{message}"):
        check_reward_output("my_reward", {"score": bad}, 2)


def test_bad_reward_inside_a_multi_reward_names_it():
    @register_reward("test_broken")
    def broken():
        return lambda images, prompts, metadata: {"test_broken": torch.ones(images.shape[0], 2)}

    with pytest.raises(RewardError, match="reward `test_broken`"):
        WeightedReward([RewardSpec("test_broken")])(_images(True), ["a", "b"], [{}, {}])


def test_a_reward_that_raises_is_named_with_where_it_raised():
    @register_reward("test_raises")
    def raises():
        def score(images, prompts, metadata):
            return {"test_raises": [][3]}

        return score

    with pytest.raises(RewardError, match=r"reward `test_raises` raised IndexError: .*test_rewards\.py:\d+, in score"):
        WeightedReward([RewardSpec("test_raises")])(_images(True), ["a", "b"], [{}, {}])


def test_weights_that_overflow_the_sum_are_an_error():
    @register_reward("test_big")
    def big():
        return lambda images, prompts, metadata: {"test_big": torch.full((len(images),), 1e14)}

    assert WeightedReward([RewardSpec("test_big", 1e6)])  # each score is in range ...
    with pytest.raises(RewardError, match="weighted sum of the rewards overflowed"):
        WeightedReward([RewardSpec("test_big", 1e30)])(_images(True), ["a", "b"], [{}, {}])  # ... their sum is not


def test_unknown_reward_option_is_named():
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="qualty"):
        get_reward("jpeg_compressibility", qualty=90)
    # and at start-up, before any worker exists, naming the config field
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.options.*qualty"):
        load_config("flow_grpo_tiny", ["reward.functions=[{name: jpeg_compressibility, options: {qualty: 90}}]"])


def test_delayed_reward_returns_the_named_rewards_scores_after_its_wait():
    import time

    images = torch.randint(0, 256, (3, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    slow = get_reward("delayed", reward="jpeg_compressibility", seconds_per_image=0.1, reward_options={"scale": 2.0})
    started = time.perf_counter()
    scores = slow(images, [""] * 3, [{}] * 3)
    assert time.perf_counter() - started >= 0.3
    assert torch.equal(scores["jpeg_compressibility"],
                       get_reward("jpeg_compressibility", scale=2.0)(images, [], [])["jpeg_compressibility"])


@pytest.mark.parametrize("options, field", [
    ({"reward": "delayed"}, "options.reward"),
    ({"reward": "no_such_reward"}, "options.reward"),
    ({"seconds_per_image": -1}, "options.seconds_per_image"),
    ({"reward_options": {"sharpness": 1}}, "options.reward_options"),
])
def test_delayed_reward_options_are_checked_with_the_config(tiny_pixel_path, options, field):
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    spec = "{name: delayed, weight: 1.0, options: %s}" % str(options).replace("'", "")
    with pytest.raises(ConfigError) as error:
        load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", f"reward.functions=[{spec}]"])
    assert f"reward.functions[0].{field}" in str(error.value)


def test_image_rewards_score_videos_per_frame_and_average_and_video_rewards_see_whole_videos():
    @register_reward("test_frame_brightness")
    def frame_brightness():
        def score(images, prompts, metadata):
            assert images.ndim == 4 and len(prompts) == len(images) == len(metadata)
            return {"test_frame_brightness": images.float().mean(dim=(1, 2, 3))}
        return score

    @register_reward("test_video_length")
    def video_length():
        def score(videos, prompts, metadata):
            return {"test_video_length": torch.full((len(videos),), float(videos.shape[1]))}
        score.scores_videos = True
        return score

    videos = torch.zeros(2, 3, 4, 4, 3, dtype=torch.uint8)
    videos[0, 0], videos[0, 1], videos[0, 2] = 30, 60, 120  # frames of video 0: mean (30 + 60 + 120) / 3 = 70
    videos[1] = 9
    reward = WeightedReward([RewardSpec("test_frame_brightness", 1.0), RewardSpec("test_video_length", 0.5)])
    out = reward(videos, ["a", "b"], [{}, {}])
    assert out["test_frame_brightness"].tolist() == [70.0, 9.0]
    assert out["test_video_length"].tolist() == [3.0, 3.0]
    assert out["overall"].tolist() == [71.5, 10.5]
