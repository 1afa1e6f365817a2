"""The reward-hacking watch (trainers/hacking.py): each rule against the first validation, by
hand; the config's refusals; a tiny run that stops at the flag with a checkpoint and resumes
against the run's first validation."""

import math

import pytest

from conftest import read_metrics, train_cli
from pixelrl.config.sections import HackingWatch
from pixelrl.core.errors import ConfigError
from pixelrl.trainers.hacking import HackingMonitor, first_validation, hacking_evidence, hacking_lines

N = 4


def _row(step=0, reward=0.3, gold=0.6, strict=0.4, diversity=0.1, **stats):
    image = {"dark_fraction": 0.8, "brightness": 0.07, "saturation": 0.78, "colour_entropy": 0.93,
             "edge_density": 0.09, "grain": 0.015, **stats}
    return {"step": step, f"val-core/overall/reward/mean@{N}": reward,
            f"val-core/overall/gold/shapes_geneval/mean@{N}": gold,
            f"val-core/overall/gold/shapes_strict/mean@{N}": strict,
            f"val-core/overall/diversity@{N}": diversity, **{f"val-aux/image/{k}": v for k, v in image.items()}}


def _tripped(first, row, watch=None, gold=("shapes_geneval",)):
    evidence = hacking_evidence(first, row, N, watch or HackingWatch(), list(gold))
    return {rule for rule, lines in evidence.items() if lines}, evidence


def test_proxy_up_while_gold_down_trips_only_both_together():
    first = _row()
    assert _tripped(first, _row(reward=0.5, gold=0.7))[0] == set()  # both up: learning
    assert _tripped(first, _row(reward=0.2, gold=0.3))[0] == set()  # both down: a bad run, not a hacked reward
    assert _tripped(first, _row(reward=0.5, gold=0.59))[0] == set()  # gold within gold_drop (0.02)
    rules, evidence = _tripped(first, _row(reward=0.5, gold=0.5))
    assert rules == {"proxy_vs_gold"}
    assert evidence["proxy_vs_gold"] == ["reward +0.2 (0.3 -> 0.5) while gold shapes_geneval -0.1 (0.6 -> 0.5; "
                                         "gold_drop 0.02)"]
    # the default watches each gold function's own score; shapes_strict is watched when named
    assert _tripped(first, _row(reward=0.5, strict=0.1))[0] == set()
    assert _tripped(first, _row(reward=0.5, strict=0.1), HackingWatch(gold=["shapes_strict"]))[0] == {"proxy_vs_gold"}
    # proxy_rise: the reward must rise by more than it
    assert _tripped(first, _row(reward=0.5, gold=0.5), HackingWatch(proxy_rise=0.25))[0] == set()
    assert _tripped(first, _row(reward=0.5, gold=0.5), HackingWatch(gold_drop=math.inf))[0] == set()


def test_a_single_source_is_read_under_its_own_name():
    def single(row):
        return {k.replace("/overall/", "/shapes/"): v for k, v in row.items()}

    assert _tripped(single(_row()), single(_row(reward=0.5, gold=0.5)))[0] == {"proxy_vs_gold"}


def test_each_image_statistic_trips_past_its_own_limit():
    first, watch = _row(), HackingWatch()
    for name, limit in watch.drift.items():
        inside = _row(**{name: first[f"val-aux/image/{name}"] + 0.9 * limit})
        outside = _row(**{name: first[f"val-aux/image/{name}"] - 1.1 * limit})
        assert _tripped(first, inside)[0] == set(), name
        rules, evidence = _tripped(first, outside)
        assert rules == {"image_drift"} and evidence["image_drift"][0].startswith(f"{name} -"), name
    off = HackingWatch(drift={**watch.drift, "dark_fraction": math.inf})
    assert _tripped(first, _row(dark_fraction=1.0), off)[0] == set()


def test_diversity_below_its_floor_of_the_first_validation():
    first = _row(diversity=0.1)
    assert _tripped(first, _row(diversity=0.051))[0] == set()
    rules, evidence = _tripped(first, _row(diversity=0.049))
    assert rules == {"diversity"} and "49% of the first validation's 0.1" in evidence["diversity"][0]
    assert _tripped(first, _row(diversity=0.0), HackingWatch(diversity_floor=0.0))[0] == set()


def test_gold_names_the_rewards_do_not_give_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"val_kwargs.hacking.gold.*\['shapes_geneval', 'shapes_strict'\]"):
        _tripped(_row(), _row(), HackingWatch(gold=["shapes_exactly"]))


def test_the_monitor_baseline_is_its_first_row_or_the_seeded_one():
    said = []
    monitor = HackingMonitor(HackingWatch(), N, ["shapes_geneval"], console=said.append)
    assert monitor.metrics(_row(step=10), 10)["val-aux/hacking/suspected"] == 0.0
    assert said and "trainer.val_before_train=true" in said[0]  # a baseline taken after training began
    flags = monitor.metrics(_row(step=20, dark_fraction=1.0), 20)
    assert flags["val-aux/hacking/image_drift"] == 1.0 and flags["val-aux/hacking/suspected"] == 1.0
    assert monitor.summary().startswith("image_drift: dark_fraction +0.2")
    rows = [{"step": 1, "critic/rewards/mean": 0.1}, _row(step=2, dark_fraction=1.0), _row(step=4)]
    assert first_validation(rows, 4)["step"] == 2 and first_validation(rows, 1) is None
    seeded = HackingMonitor(HackingWatch(), N, ["shapes_geneval"], console=said.append)
    seeded.seed(first_validation(rows, 4))
    assert seeded.metrics(_row(step=6), 6)["val-aux/hacking/image_drift"] == 1.0  # 1.0 -> 0.8 against step 2
    assert HackingMonitor(HackingWatch(enabled=False), N, [], console=said.append).metrics(_row(), 0) == {}


def test_the_report_verdict_is_recomputed_from_the_rows():
    config = {"val_kwargs": {"n": N, "rewards": [{"name": "shapes_geneval"}]}}
    rows = [_row(step=0), {"step": 1}, _row(step=30, reward=0.5, gold=0.1)]
    lines = hacking_lines(rows, config)
    assert len(lines) == 1 and lines[0].startswith("step 30: reward hacking suspected: proxy_vs_gold: reward +0.2")
    assert hacking_lines(rows[:2] + [_row(step=30)], config)[0].startswith("No validation flagged")
    assert hacking_lines(rows, {"val_kwargs": {**config["val_kwargs"], "hacking": {"enabled": False}}}) == []


@pytest.mark.parametrize("overrides, field", [
    (["val_kwargs.hacking.drift={darkness: 0.1}"], "val_kwargs.hacking.drift"),
    (["val_kwargs.hacking.drift={grain: -1}"], "val_kwargs.hacking.drift.grain"),
    (["val_kwargs.hacking.diversity_floor=1.5"], "val_kwargs.hacking.diversity_floor"),
    (["val_kwargs.hacking.gold=[shapes_strict]"], "val_kwargs.hacking.gold"),
    (["trainer.stop_when_hacking=true", "trainer.test_freq=-1"], "trainer.stop_when_hacking"),
    (["trainer.stop_when_hacking=true", "trainer.test_freq=2"], "trainer.stop_when_hacking"),
    (["trainer.stop_when_hacking=true", "trainer.test_freq=2", "trainer.val_before_train=true",
      "val_kwargs.hacking.enabled=false"], "trainer.stop_when_hacking"),
])
def test_the_config_refuses_a_watch_that_cannot_work(overrides, field):
    from pixelrl.config.validation import load_config

    with pytest.raises(ConfigError) as err:
        load_config("flow_grpo_tiny", overrides)
    assert err.value.field == field


def test_a_run_stops_at_the_flag_with_a_checkpoint_and_resumes_against_its_first_validation(
        tmp_path, tiny_pixel_path, capsys):
    import json

    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"prompt": p, "data_source": "shapes"}) for p in ("a red circle", "a cat")))
    # any change in the images' brightness trips: the first update does it
    common = ("trainer.backend=local", "trainer.logger=[jsonl]", f"data.val_files=[{val}]", "val_kwargs.n=2",
              "val_kwargs.num_steps=4", "trainer.val_before_train=true", "trainer.test_freq=1", "trainer.save_freq=0",
              "val_kwargs.hacking.drift={brightness: 1e-7}", "val_kwargs.hacking.diversity_floor=0")
    code, run = train_cli(tmp_path, tiny_pixel_path, *common, "trainer.total_training_steps=3",
                          "trainer.stop_when_hacking=true")
    assert code == 0
    out = capsys.readouterr().out
    assert "step 1: reward hacking suspected (val_kwargs.hacking): image_drift: brightness" in out
    assert "stopping after step 1 (trainer.stop_when_hacking)" in out
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["val-aux/hacking/suspected"] == 1.0
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_1"]
    # on, without the stop: step 2 is compared with step 0's validation, read back from the rows
    code, _ = train_cli(tmp_path, tiny_pixel_path, *common, "trainer.total_training_steps=2")
    assert code == 0
    rows = read_metrics(run)
    first, last = rows[0], rows[-1]
    assert last["step"] == 2 and last["val-aux/hacking/image_drift"] == 1.0
    assert last["val-aux/image/brightness_drift"] == pytest.approx(
        last["val-aux/image/brightness"] - first["val-aux/image/brightness"])
    assert "compares later validations with this one" not in capsys.readouterr().out


def test_the_report_page_shows_the_verdict(tmp_path):
    import json

    from pixelrl.trainers.report import write_report

    rows = [_row(step=0), _row(step=30, reward=0.5, gold=0.1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(f"val_kwargs:\n  n: {N}\n  rewards:\n  - name: shapes_geneval\n")
    page = write_report(tmp_path).read_text()
    verdict = page[page.index('<div id="hacking">'):]
    assert verdict.index("step 30: reward hacking suspected: proxy_vs_gold") < verdict.index("</div>")


def test_gold_rewards_score_every_steps_rollouts_when_asked(tmp_path, tiny_pixel_path):
    """val_kwargs.gold_on_rollouts: each step's rollout images are scored by the gold rewards too;
    JPEG incompressibility is the training reward (JPEG compressibility) negated, on the same images."""
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "trainer.total_training_steps=2", "val_kwargs.gold_on_rollouts=true",
                          "val_kwargs.rewards=[{name: jpeg_incompressibility}]")
    assert code == 0
    rows = read_metrics(run)
    assert len(rows) == 2
    for row in rows:
        assert row["critic/gold/jpeg_incompressibility/mean"] == pytest.approx(-row["critic/rewards/mean"], abs=1e-6)
    with pytest.raises(ConfigError, match="val_kwargs.gold_on_rollouts"):
        from pixelrl.config.validation import load_config

        load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "val_kwargs.gold_on_rollouts=true"])
