"""A scorer that fails: the step stops the run (default, `reward.on_error=stop`) or is skipped
(`skip`: no update, the row says so, the run goes on) until `reward.max_consecutive_errors`
failures in a row stop it. Never a silent zero reward."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, train_cli

# fails on the calls listed in `fail_calls` (1-based, counted in a file beside the module)
FLAKY = textwrap.dedent('''
    import time
    from pathlib import Path

    import torch

    from pixelrl.rewards import register_reward

    COUNTER = Path(__file__).parent / "calls.txt"


    @register_reward("flaky")
    def flaky(fail_calls: list = (), hang_calls: list = ()):
        def score(images, prompts, metadata):
            calls = int(COUNTER.read_text()) + 1 if COUNTER.is_file() else 1
            COUNTER.write_text(str(calls))
            if calls in fail_calls:
                raise ConnectionError(f"scorer unreachable on call {calls}")
            if calls in hang_calls:
                time.sleep(600)  # a scorer that never answers
            return {"flaky": images.float().mean(dim=(1, 2, 3)) / 255}
        return score
''')


@pytest.fixture
def flaky_plugin(tmp_path, monkeypatch):
    from pixelrl.rewards import REWARDS

    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))
    path = tmp_path / "plugin" / "flaky.py"
    path.parent.mkdir()
    path.write_text(FLAKY)
    return path


def _run(tmp_path, model, plugin, fail_calls, *extra, steps=4, hang_calls=()):
    return train_cli(tmp_path / "runs", model, f"plugins=[{plugin}]", "trainer.backend=local",
                     "trainer.logger=[jsonl]", "trainer.save_freq=1", f"trainer.total_training_steps={steps}",
                     f"reward.functions=[{{name: flaky, options: {{fail_calls: {list(fail_calls)}, "
                     f"hang_calls: {list(hang_calls)}}}}}]", *extra)


def _weights(run, step):
    return load_file(run / "checkpoints" / f"global_step_{step}" / "actor" / "trainable.safetensors")


def test_by_default_a_failing_scorer_stops_the_run_naming_it(tmp_path, tiny_pixel_path, flaky_plugin, capsys):
    code, run = _run(tmp_path, tiny_pixel_path, flaky_plugin, [2])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "flaky" in err and "scorer unreachable on call 2" in err and "reward.on_error=skip" in err, err
    assert [m["step"] for m in read_metrics(run)] == [1]


def test_skip_leaves_the_weights_and_logs_the_step_then_trains_on(tmp_path, tiny_pixel_path, flaky_plugin, capsys):
    code, run = _run(tmp_path, tiny_pixel_path, flaky_plugin, [2], "reward.on_error=skip")
    assert code == 0
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert [m["reward/error"] for m in rows] == [0.0, 1.0, 0.0, 0.0]
    assert "critic/rewards/mean" not in rows[1] and "actor/pg_loss" not in rows[1]  # nothing made up for it
    assert all("critic/rewards/mean" in rows[i] for i in (0, 2, 3))
    w1, w2, w3 = (_weights(run, s) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the skipped step changed nothing
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # the next one trained
    assert "step 2: reward failed" in capsys.readouterr().out


def test_skip_stops_after_too_many_failures_in_a_row(tmp_path, tiny_pixel_path, flaky_plugin, capsys):
    code, run = _run(tmp_path, tiny_pixel_path, flaky_plugin, [2, 3, 4, 5], "reward.on_error=skip",
                     "reward.max_consecutive_errors=3", steps=6)
    err = capsys.readouterr().err
    assert code == 2 and "3 steps in a row" in err and "reward.max_consecutive_errors" in err, err
    assert [m["reward/error"] for m in read_metrics(run)] == [0.0, 1.0, 1.0, 1.0]
    assert json.loads((run / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())["global_step"] == 3


@pytest.mark.slow  # ~11 s; the default run skips in-process (above) and reports Ray worker failures (test_runtime_ray.py)
def test_skip_sees_the_error_of_a_scorer_in_a_ray_reward_worker(ray_cluster, tmp_path, tiny_pixel_path, flaky_plugin,
                                                               capsys):
    code, run = _run(tmp_path, tiny_pixel_path, flaky_plugin, [2], "reward.on_error=skip", "trainer.backend=ray",
                     "trainer.n_workers=2", steps=3)
    assert code == 0
    assert [m["reward/error"] for m in read_metrics(run)] == [0.0, 1.0, 0.0]
    out = capsys.readouterr().out
    assert "step 2: reward failed (reward `flaky` raised ConnectionError: scorer unreachable on call 2" in out, out


def test_a_plugin_reward_that_hangs_fails_at_reward_timeout_s_and_skip_goes_on(tmp_path, tiny_pixel_path,
                                                                               flaky_plugin, capsys):
    """An in-process plugin reward that never answers: its call fails after reward.timeout_s like
    a reward that raised; with skip the step is skipped and the run trains on."""
    code, run = _run(tmp_path, tiny_pixel_path, flaky_plugin, [], "reward.on_error=skip", "reward.timeout_s=2",
                     steps=3, hang_calls=[2])
    rows = read_metrics(run)
    assert code == 0 and [m["reward/error"] for m in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["timing_s/step"] < 300  # the skipped step waited for the deadline, not the 600 s sleep
    out = capsys.readouterr().out
    assert "reward `flaky` gave no scores for 16 samples within reward.timeout_s=2 s" in out, out


def test_the_deadline_is_the_rewards_own_and_errors_pass_through_it():
    """`WeightedReward` with a deadline: a slow reward fails within it, naming reward.timeout_s;
    a fast one scores as without; a reward's own TimeoutError is reported as the reward raised it."""
    import time

    from pixelrl.core.errors import RewardError
    from pixelrl.rewards import REWARDS, WeightedReward, register_reward

    saved = dict(REWARDS._entries)
    try:
        @register_reward("slow_for_test")
        def slow(seconds: float = 0.0):
            def score(images, prompts, metadata):
                if seconds < 0:
                    raise TimeoutError("the scorer's own socket timed out")
                time.sleep(seconds)
                return {"slow_for_test": torch.ones(len(prompts))}
            return score

        images = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)
        fast = WeightedReward.from_functions([{"name": "slow_for_test"}], timeout_s=5)
        assert fast(images, ["a", "b"], [{}, {}])["overall"].tolist() == [1.0, 1.0]
        began = time.monotonic()
        with pytest.raises(RewardError, match=r"within reward.timeout_s=0.3 s"):
            WeightedReward.from_functions([{"name": "slow_for_test", "options": {"seconds": 30}}], timeout_s=0.3)(
                images, ["a", "b"], [{}, {}])
        assert time.monotonic() - began < 5
        with pytest.raises(RewardError, match=r"raised TimeoutError: the scorer's own socket timed out"):
            WeightedReward.from_functions([{"name": "slow_for_test", "options": {"seconds": -1}}], timeout_s=5)(
                images, ["a", "b"], [{}, {}])
    finally:
        REWARDS._entries.clear()
        REWARDS._entries.update(saved)

