"""Reproducibility standards (shapes/standards.py): the comparison by hand, and every standard
rerun against its committed record through `pixelrl reproduce`."""

import pytest

from pixelrl.shapes.standards import STANDARDS, compare, compared_values, load_record


def test_every_number_but_timings_and_counters_is_compared_each_at_its_step():
    rows = [{"step": 1, "actor/pg_loss": 0.5, "critic/rewards/mean": -1.0, "timing_s/step": 3.0,
             "actor/throughput": 9.0, "training/global_step": 1, "perf/mfu": 0.1, "timeline/train_end": 1.7e9},
            {"step": 2, "actor/pg_loss": 0.25, "val/accuracy": 0.5}]
    assert compared_values(rows) == {"actor/pg_loss@1": 0.5, "critic/rewards/mean@1": -1.0, "actor/pg_loss@2": 0.25,
                                     "val/accuracy@2": 0.5}


def test_the_comparison_by_hand():
    recorded = {"a@1": 1.0, "b@1": -2.0, "c@1": float("nan")}
    same = compare("x", recorded, dict(recorded))
    assert same.bitwise and same.passed and same.verdict() == "bitwise: 3 values equal"
    rounded = compare("x", recorded, {**recorded, "b@1": -2.0002, "a@1": 1.0 + 5e-7})
    assert rounded.passed and not rounded.bitwise and rounded.max_relative == pytest.approx(1e-4, rel=1e-3)
    assert rounded.verdict().startswith("1 of 3 values equal, within rtol 0.05 / atol 1e-06; largest relative "
                                        "difference 0.0001 (b@1: -2.0 recorded, -2.0002 now)")
    moved = compare("x", recorded, {**recorded, "b@1": -2.2})  # 9% > RTOL
    assert not moved.passed and "1 DIFFER beyond rtol" in moved.verdict()
    assert not compare("x", {"a@1": 0.0}, {"a@1": 2e-6}).passed  # past ATOL near zero
    lost = compare("x", recorded, {"a@1": 1.0, "c@1": float("nan"), "d@1": 0.0})
    assert not lost.passed and lost.missing == ["b@1"] and lost.extra == ["d@1"]


def test_every_standard_has_a_record_of_its_own_settings():
    for name, standard in STANDARDS.items():
        record = load_record(name)
        assert (record["config"], record["overrides"]) == (standard.config, list(standard.overrides)), name
        steps = {key.rsplit("@", 1)[1] for key in record["values"]}
        assert len(steps) >= 3, (name, steps)  # every step of the run, not its first only


# the three fastest (about 15 s together); all eight take about 90 s on a 2-core Xeon
QUICK = ["dpo", "dmd2", "vlm_grpo"]


@pytest.mark.parametrize("names", [QUICK, pytest.param(["all"], marks=pytest.mark.slow)], ids=["quick", "all"])
def test_pixelrl_reproduce_matches_the_records(names, capsys):
    from pixelrl.cli import main

    code = main(["reproduce", *names])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    verdicts = {line.split()[0]: line for line in out[1:]}
    assert sorted(verdicts) == sorted(STANDARDS if names == ["all"] else names)
    assert all("DIFFER" not in line for line in verdicts.values()), out
