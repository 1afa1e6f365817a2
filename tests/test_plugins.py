"""Plugins: the user's own reward, registered in a module listed under `plugins:`, reaches every
process of a run (the driver's validation, in-process workers, Ray policy and reward workers)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from conftest import read_metrics, train_cli

# A reward of the user's own. Every process that imports the module leaves a marker named by its
# pid; every scoring call appends its scores and the scoring pid to calls.jsonl.
PLUGIN = textwrap.dedent('''
    import json, os
    from pathlib import Path

    import torch

    from pixelrl.rewards import register_reward

    HERE = Path(__file__).parent
    (HERE / f"imported_{os.getpid()}").touch()


    @register_reward("mean_red")
    def mean_red(scale: float = 1.0):
        def score(images, prompts, metadata):
            values = images[..., 0].float().mean(dim=(1, 2)) / 255 * scale
            with open(HERE / "calls.jsonl", "a") as log:
                log.write(json.dumps({"pid": os.getpid(), "scores": values.tolist()}) + "\\n")
            return {"mean_red": values}
        return score


    @register_reward("keyed")
    def keyed(api_key: str = ""):
        def score(images, prompts, metadata):  # 1 when the worker was handed the real key
            return {"keyed": torch.full((len(prompts),), float(api_key == "s3cr3t-token-0123456789"))}
        return score
''')


@pytest.fixture
def plugin_file(tmp_path, monkeypatch):
    from pixelrl.rewards import REWARDS

    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))  # each test's mean_red is forgotten after it
    folder = tmp_path / "plugin"
    folder.mkdir()
    path = folder / "my_rewards.py"
    path.write_text(PLUGIN)
    return path


def _calls(folder):
    return [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]


def _importers(folder):
    return {int(p.name.split("_")[1]) for p in folder.glob("imported_*")}


def test_a_reward_from_a_plugin_file_trains_on_two_ray_workers(ray_cluster, tmp_path, tiny_pixel_path, plugin_file):
    code, run = train_cli(tmp_path / "runs", tiny_pixel_path, f"plugins=[{plugin_file}]", "trainer.backend=ray",
                          "trainer.n_workers=2", "trainer.total_training_steps=2", "trainer.save_freq=-1",
                          "trainer.logger=[jsonl]", "reward.functions=[{name: mean_red, options: {scale: 2.0}}]")
    assert code == 0
    folder = plugin_file.parent
    importers = _importers(folder)
    # the driver (validation) and at least the two policy workers and one reward worker
    assert os.getpid() in importers and len(importers - {os.getpid()}) >= 3, importers
    calls = _calls(folder)
    assert {c["pid"] for c in calls} <= importers - {os.getpid()}  # scored in Ray reward workers
    scores = [s for c in calls for s in c["scores"]]
    metrics = read_metrics(run)
    assert len(metrics) == 2 and all(0 < s <= 2.0 for s in scores)
    # the scores the plugin computed are the rewards the run trained on
    logged = sum(m["critic/rewards/mean"] for m in metrics) / len(metrics)
    assert logged == pytest.approx(sum(scores) / len(scores), rel=1e-5)
    saved = (run / "config.yaml").read_text()
    assert str(plugin_file) in saved  # absolute: a worker started elsewhere finds it


def test_a_plugin_module_on_the_path_is_imported_once_in_one_process(tmp_path, tiny_pixel_path, plugin_file,
                                                                    monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    code, run = train_cli(tmp_path / "runs", tiny_pixel_path, "plugins=[my_rewards]", "trainer.backend=local",
                          "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                          "reward.functions=[{name: mean_red}]")
    assert code == 0
    assert _importers(plugin_file.parent) == {os.getpid()}  # the worker in this process reused the import
    scores = [s for c in _calls(plugin_file.parent) for s in c["scores"]]
    assert read_metrics(run)[0]["critic/rewards/mean"] == pytest.approx(sum(scores) / len(scores), rel=1e-5)


def test_a_relative_plugin_path_is_made_absolute_and_imported_once(tmp_path, plugin_file, monkeypatch):
    from pixelrl.core.plugins import import_plugins, resolve_plugins
    from pixelrl.rewards import REWARDS

    monkeypatch.chdir(plugin_file.parent)
    assert resolve_plugins(["my_rewards.py"]) == [str(plugin_file)]
    import_plugins(["my_rewards.py"])
    import_plugins([str(plugin_file)])  # the same file again: no second registration error
    assert "mean_red" in REWARDS and len(_importers(plugin_file.parent)) == 1


def test_a_secret_from_the_environment_reaches_the_reward_but_no_file_of_the_run(tmp_path, tiny_pixel_path,
                                                                                 plugin_file, monkeypatch, capsys):
    secret = "s3cr3t-token-0123456789"
    monkeypatch.setenv("PIXELRL_TEST_API_KEY", secret)
    overrides = (f"plugins=[{plugin_file}]", "trainer.backend=local", "trainer.save_freq=1",
                 "trainer.logger=[console,jsonl,tensorboard]",
                 "reward.functions=[{name: keyed, options: {api_key: '${oc.env:PIXELRL_TEST_API_KEY}'}}]")
    code, run = train_cli(tmp_path / "runs", tiny_pixel_path, *overrides, "trainer.total_training_steps=1")
    assert code == 0
    assert read_metrics(run)[0]["critic/rewards/mean"] == 1.0  # the worker saw the value
    # a resume compares the saved config with this run's: the interpolation text on both sides
    code, _ = train_cli(tmp_path / "runs", tiny_pixel_path, *overrides, "trainer.total_training_steps=2")
    assert code == 0 and [m["critic/rewards/mean"] for m in read_metrics(run)] == [1.0, 1.0]
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any("tfevents" in p.name for p in files)
    assert not [p for p in files if secret.encode() in p.read_bytes()]
    assert secret not in capsys.readouterr().out
    saved = (run / "checkpoints" / "global_step_2" / "config.yaml").read_text()
    assert "${oc.env:PIXELRL_TEST_API_KEY}" in saved
    # reading the checkpoint's config back takes the text literally, never the reader's environment
    from pixelrl.config.sections import from_yaml_text

    monkeypatch.delenv("PIXELRL_TEST_API_KEY")
    options = from_yaml_text(saved).reward.functions[0]["options"]
    assert options["api_key"] == "${oc.env:PIXELRL_TEST_API_KEY}"
