"""The image statistics every validation logs, by hand on constructed pictures."""

import math

import pytest
import torch

from pixelrl.engine.image_stats import StatisticsDrift, image_statistics, mean_image_statistics


def _picture(fill, size=8):
    return torch.tensor(fill, dtype=torch.uint8).expand(size, size, 3).clone()


def test_black_white_and_a_saturated_square_by_hand():
    black, white, red = _picture([0, 0, 0]), _picture([255, 255, 255]), _picture([255, 0, 0])
    s = image_statistics(torch.stack([black, white, red]))
    assert s["dark_fraction"].tolist() == [1.0, 0.0, 0.0]
    assert s["brightness"].tolist() == pytest.approx([0.0, 1.0, 0.299])
    assert s["saturation"].tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert s["colour_entropy"].tolist() == [0.0, 0.0, 0.0]  # one colour each
    assert s["edge_density"].tolist() == [0.0, 0.0, 0.0] and s["grain"].tolist() == [0.0, 0.0, 0.0]


def test_halves_speckle_and_entropy_by_hand():
    halves = _picture([0, 0, 0])
    halves[:, 4:] = 255  # one vertical edge between columns 3 and 4
    s = image_statistics(halves[None])
    assert float(s["dark_fraction"]) == 0.5 and float(s["colour_entropy"]) == pytest.approx(1.0)
    assert float(s["edge_density"]) == pytest.approx(8 / 64)  # column 3's pixels see the step to their right
    speckled = _picture([0, 0, 0])
    speckled[::2, ::2] = 255  # isolated bright pixels: grain, not structure
    assert float(image_statistics(speckled[None])["grain"]) > float(image_statistics(halves[None])["grain"])


def test_sizes_videos_and_the_drift_from_the_first_validation():
    small, large = _picture([0, 0, 0], 4), _picture([255, 255, 255], 8)
    assert mean_image_statistics([small, large])["dark_fraction"] == 0.5  # a mean over images, not pixels
    video = torch.stack([_picture([0, 0, 0]), _picture([255, 255, 255])])[None]  # [1, T=2, H, W, 3]
    assert mean_image_statistics(video)["brightness"] == pytest.approx(0.5)
    drift = StatisticsDrift()
    first = drift.metrics(torch.stack([small, small]))
    assert first["val-aux/image/dark_fraction"] == 1.0 and first["val-aux/image/dark_fraction_drift"] == 0.0
    later = drift.metrics(torch.stack([small, _picture([255, 255, 255], 4)]))
    assert later["val-aux/image/dark_fraction_drift"] == pytest.approx(-0.5)


def test_the_report_draws_each_statistic_beside_the_reward():
    from pixelrl.trainers.report import curve_keys

    rows = [{"step": 1, "critic/rewards/mean": 0.1, "val-aux/image/dark_fraction": 0.5,
             "val-aux/image/dark_fraction_drift": 0.0, "val-aux/image/grain": 0.01}]
    keys = curve_keys(rows)
    assert keys[0] == "critic/rewards/mean" and {"val-aux/image/dark_fraction", "val-aux/image/grain"} <= set(keys)
    assert "val-aux/image/dark_fraction_drift" not in keys


def test_the_sample_statistics_by_hand_and_their_drift_from_where_they_first_appear():
    from pixelrl.engine.image_stats import source_distance, x0_rms

    x0 = torch.stack([torch.full((2, 3, 3), 2.0), torch.tensor([3.0, -4.0]).repeat(9).reshape(2, 3, 3)])
    assert x0_rms(x0).tolist() == pytest.approx([2.0, math.sqrt(12.5)])
    edit, source = _picture([255, 0, 0], 4), _picture([0, 0, 0], 8)  # a source at twice the edit's size
    assert source_distance(edit[None], [(source,)]) == pytest.approx(1 / 3)
    assert source_distance([edit, source], [(source,), (source,)]) == pytest.approx(1 / 6)  # several sizes
    drift = StatisticsDrift()
    drift.metrics(torch.stack([edit]), {"x0_rms": 1.0})
    later = drift.metrics(torch.stack([edit]), {"x0_rms": 1.5, "source_distance": 0.2})
    assert later["val-aux/image/x0_rms_drift"] == 0.5 and later["val-aux/image/source_distance_drift"] == 0.0
    resumed = StatisticsDrift()
    resumed.seed({"val-aux/image/x0_rms": 1.0, "val-aux/image/dark_fraction": 1.0, "critic/rewards/mean": 3})
    assert resumed.first == {"x0_rms": 1.0, "dark_fraction": 1.0}
    assert resumed.metrics(torch.stack([edit]), {"x0_rms": 2.0})["val-aux/image/x0_rms_drift"] == 1.0
