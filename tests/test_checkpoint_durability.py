"""Checkpoints survive kills and power loss: fsync before every rename, no half-deleted step
folder, rotation that never deletes what was just written, and metrics rows that are neither
lost nor doubled by a resume."""

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, train_cli
from pixelrl.trainers import checkpointing
from pixelrl.core.errors import ConfigError
from pixelrl.trainers.checkpointing import (POINTER, BestCheckpoint, best_checkpoint_folder, list_checkpoints,
                                           save_checkpoint)


def _fake_actor(folder: str) -> None:
    Path(folder).mkdir()
    (Path(folder) / "trainable.safetensors").write_bytes(b"weights")


def _save(root, step, max_keep=0, marker="a"):
    return save_checkpoint(root, step, _fake_actor, {"marker": marker}, "config: 1", max_keep)


def _complete(folder: Path) -> bool:
    return (folder / "trainer_state.json").is_file() and (folder / "actor" / "trainable.safetensors").is_file()


def test_every_file_and_folder_is_synced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(checkpointing.os, "fsync", record)
    _save(tmp_path, 1)
    tmp = str(tmp_path / "global_step_1.tmp")
    for name in ("data.pt", "trainer_state.json", "config.yaml", "actor/trainable.safetensors", "actor"):
        assert f"{tmp}/{name}" in synced, name
    assert tmp in synced  # the folder's own entries
    assert str(tmp_path / (POINTER + ".tmp")) in synced  # the pointer's text, before its rename
    assert synced.count(str(tmp_path)) >= 2  # the renames of the folder and of the pointer


def test_a_kill_during_rotation_leaves_no_half_deleted_step_folder(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    real_rmtree = checkpointing.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        if str(path).endswith(".deleting") and Path(path).is_dir():
            (Path(path) / "data.pt").unlink()  # part of the folder is gone ...
            raise KeyboardInterrupt("kill during rotation")  # ... when the kill comes
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpointing.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, max_keep=1)
    # every folder named like a step is a complete checkpoint, and the pointer names the new one
    assert list_checkpoints(tmp_path) and all(_complete(tmp_path / f"global_step_{s}") for s in list_checkpoints(tmp_path))
    assert (tmp_path / POINTER).read_text() == "4"
    monkeypatch.setattr(checkpointing.shutil, "rmtree", real_rmtree)
    _save(tmp_path, 5, max_keep=1)  # the next save clears what the kill left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_5", POINTER]


def test_a_kill_while_resaving_a_step_never_loses_it(tmp_path, monkeypatch):
    import torch

    from pixelrl.trainers.checkpointing import find_resume_folder

    _save(tmp_path, 1, marker="first")

    def crash(tmp_folder):
        raise KeyboardInterrupt("kill before the new folder is complete")

    monkeypatch.setattr(checkpointing, "_before_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, marker="second")
    assert torch.load(tmp_path / "global_step_1" / "data.pt", weights_only=True) == {"marker": "first"}

    # killed after the old folder was moved aside, before the new one was renamed in
    monkeypatch.setattr(checkpointing, "_before_commit", lambda tmp_folder: None)
    real_replace = checkpointing.os.replace

    def killed_at_rename(src, dst):
        if str(src).endswith("global_step_1.tmp"):
            raise KeyboardInterrupt("kill between the two renames")
        real_replace(src, dst)

    monkeypatch.setattr(checkpointing.os, "replace", killed_at_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, marker="third")
    monkeypatch.setattr(checkpointing.os, "replace", real_replace)
    folder = find_resume_folder(tmp_path, "auto")  # finishes the rename of the complete new folder
    assert folder == tmp_path / "global_step_1" and _complete(folder)
    assert torch.load(folder / "data.pt", weights_only=True) == {"marker": "third"}


def test_rotation_after_resuming_from_an_older_step_never_deletes_what_it_just_wrote(tmp_path):
    for step in range(1, 7):  # a first run kept everything
        _save(tmp_path, step)
    # resumed from step 4 with max_keep 2: writes step 5
    _save(tmp_path, 5, max_keep=2)
    assert (tmp_path / POINTER).read_text() == "5"
    assert list_checkpoints(tmp_path) == [4, 5, 6]  # 4 = the newest older one; 6 belongs to the first run
    assert all(_complete(tmp_path / f"global_step_{s}") for s in (4, 5, 6))


def test_a_kill_between_a_steps_row_and_its_checkpoint_neither_loses_nor_doubles_the_row(tmp_path, tiny_pixel_path,
                                                                                       monkeypatch):
    args = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=4", "trainer.save_freq=1", "trainer.total_training_steps=3")
    code, straight = train_cli(tmp_path / "straight", tiny_pixel_path, *args)
    assert code == 0

    def crash(tmp_folder):
        if tmp_folder.name.startswith("global_step_2"):
            raise KeyboardInterrupt("kill while writing the step-2 checkpoint")

    monkeypatch.setattr(checkpointing, "_before_commit", crash)
    code, run = train_cli(tmp_path / "killed", tiny_pixel_path, *args)
    assert code == 130
    assert [m["step"] for m in read_metrics(run)] == [1, 2]  # step 2's row was written before its checkpoint
    assert (run / "checkpoints" / POINTER).read_text() == "1"
    monkeypatch.setattr(checkpointing, "_before_commit", lambda tmp_folder: None)
    code, _ = train_cli(tmp_path / "killed", tiny_pixel_path, *args)
    assert code == 0
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [1, 2, 3]  # step 2 ran again and replaced its row
    assert [m["critic/rewards/mean"] for m in rows] == [m["critic/rewards/mean"] for m in read_metrics(straight)]
    assert json.loads((run / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())["global_step"] == 3


@pytest.mark.parametrize("text", ["../../elsewhere", "3/../../x", "", "-1"])
def test_the_latest_pointer_must_name_a_step_not_a_path(tmp_path, text):
    from pixelrl.core.errors import ConfigError
    from pixelrl.trainers.checkpointing import find_resume_folder

    _save(tmp_path, 3)
    (tmp_path / POINTER).write_text(text)
    with pytest.raises(ConfigError, match="not a step number"):
        find_resume_folder(tmp_path, "auto")


@pytest.fixture(scope="module")
def two_saved_steps(tmp_path_factory, tiny_pixel_path):
    out = tmp_path_factory.mktemp("two_steps")
    code, run = train_cli(out, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.save_freq=1",
                          "trainer.total_training_steps=2")
    assert code == 0
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage, file", [
    (lambda step: _truncate(step / "actor" / "trainable.safetensors"), "trainable.safetensors"),
    (lambda step: (step / "actor" / "trainable.safetensors").write_bytes(b"\xff" * 64), "trainable.safetensors"),
    (lambda step: _truncate(step / "actor" / "optimizer.pt"), "optimizer.pt"),
    (lambda step: _truncate(step / "data.pt"), "data.pt"),
    (lambda step: (step / "actor" / "engine_state.json").write_text(""), "engine_state.json"),
    (lambda step: (step / "trainer_state.json").write_text("{"), "trainer_state.json"),
], ids=["truncated_weights", "garbage_weights", "truncated_optimizer", "truncated_loader", "empty_engine_state",
        "broken_trainer_state"])
def test_a_corrupted_checkpoint_file_is_named_with_the_checkpoint_to_fall_back_to(two_saved_steps, tmp_path,
                                                                                 tiny_pixel_path, capsys, damage, file):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(two_saved_steps, out)
    root = out / "pixelrl" / "flow_grpo_tiny" / "checkpoints"
    damage(root / "global_step_2")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    code, _ = train_cli(out, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                        "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=3")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"global_step_2/{file}" in err.replace("actor/", "") or f"global_step_2/actor/{file}" in err
    assert "global_step_1" in err  # the checkpoint to fall back to
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before  # nothing written over


def test_a_checkpoint_whose_state_disagrees_with_its_folder_stops_before_anything_starts(two_saved_steps, tmp_path,
                                                                                       tiny_pixel_path, capsys):
    """global_step_2 holding step 99's trainer state would resume at 99 and train fewer steps than
    asked with exit 0: it stops, naming both steps, and writes nothing."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(two_saved_steps, out)
    root = out / "pixelrl" / "flow_grpo_tiny" / "checkpoints"
    (root / "global_step_2" / "trainer_state.json").write_text('{"global_step": 99}')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _ = train_cli(out, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                        "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=4")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "global_step_2/trainer_state.json` says global step 99, its folder says 2" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("change, field, saved", [
    ("model.lora_rank=4", "model.lora_rank", "8"),
    ("model.lora_alpha=3", "model.lora_alpha", "16"),
    ("data.train_batch_size=4", "data.train_batch_size", "2"),
    ("rollout.n=2", "rollout.n", "4"),
    ("data.seed=7", "data.seed", "1"),
    ("model.path={other}", "model.path", "pipe"),
])
def test_resuming_with_another_model_or_batch_stops_before_anything_starts(two_saved_steps, tmp_path, tiny_pixel_path,
                                                                           tiny_sd3_path, capsys, change, field, saved):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(two_saved_steps, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _ = train_cli(out, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                        "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=3",
                        change.format(other=tiny_sd3_path))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"`{field}`" in err and "global_step_2 was trained with" in err and saved in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the run folder untouched


def test_resuming_with_another_reward_or_prompts_is_refused_unless_named(two_saved_steps, tmp_path, tiny_pixel_path,
                                                                          capsys):
    """A reward or the prompts may change on resume (a curriculum), never by a forgotten override:
    refused, naming the field, the checkpoint's value and trainer.resume_changes; with the field
    named there, the run goes on and the console says what changed."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(two_saved_steps, out)
    common = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2",
              "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=3")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for change, field in (("reward.functions=[{name: jpeg_incompressibility}]", "reward.functions"),
                          ("data.prompts=[a blue moon, a red sun]", "data.prompts")):
        code, _ = train_cli(out, tiny_pixel_path, *common, change)
        err = capsys.readouterr().err
        assert code == 2 and f"`{field}`" in err and "global_step_2 was trained with" in err, err
        assert f"trainer.resume_changes=[{field}]" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the run folder untouched
    code, run = train_cli(out, tiny_pixel_path, *common, "reward.functions=[{name: jpeg_incompressibility}]",
                          "trainer.resume_changes=[reward.functions]")
    printed = capsys.readouterr().out
    assert code == 0 and [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    assert "warning: resuming global_step_2 with `reward.functions`" in printed, printed
    assert "jpeg_incompressibility" in printed and "jpeg_compressibility" in printed
    code, _ = train_cli(out, tiny_pixel_path, *common[:-1], "trainer.total_training_steps=4",
                        "reward.functions=[{name: jpeg_incompressibility}]")
    assert code == 0 and "warning" not in capsys.readouterr().out  # same reward as the checkpoint: no word


def test_kills_at_and_after_an_epoch_boundary_resume_to_the_same_weights(tmp_path, tiny_pixel_path, monkeypatch):
    """3 epochs of 2 steps (4 prompts, 2 a step, shuffled per epoch). Killed while saving step 3
    (so it resumes from step 2, the last of epoch 1), step 4 (resumes mid-epoch from 3) and step 6
    (resumes from 5): the final adapter equals the uninterrupted run's, bitwise."""
    from safetensors.torch import load_file

    args = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2",
            "data.prompts=[a red circle, two blue squares, a green tree, a yellow star]",
            "actor.ppo_mini_batch_size=4", "trainer.save_freq=1", "trainer.total_training_steps=0",
            "trainer.total_epochs=3")
    code, straight = train_cli(tmp_path / "straight", tiny_pixel_path, *args)
    assert code == 0 and [m["step"] for m in read_metrics(straight)] == [1, 2, 3, 4, 5, 6]

    for kill_at in (3, 4, 6):
        def crash(tmp_folder, kill_at=kill_at):
            if tmp_folder.name.startswith(f"global_step_{kill_at}"):
                raise KeyboardInterrupt(f"kill while writing the step-{kill_at} checkpoint")

        monkeypatch.setattr(checkpointing, "_before_commit", crash)
        code, run = train_cli(tmp_path / "killed", tiny_pixel_path, *args)
        assert code == 130 and (run / "checkpoints" / POINTER).read_text() == str(kill_at - 1)
    monkeypatch.setattr(checkpointing, "_before_commit", lambda tmp_folder: None)
    code, run = train_cli(tmp_path / "killed", tiny_pixel_path, *args)
    assert code == 0

    final = "checkpoints/global_step_6/actor/trainable.safetensors"
    resumed, uninterrupted = load_file(run / final), load_file(straight / final)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert [m["critic/rewards/mean"] for m in read_metrics(run)] == \
        [m["critic/rewards/mean"] for m in read_metrics(straight)]


def test_a_disk_that_fills_during_a_save_stops_the_run_naming_it_and_keeps_the_last_checkpoint(
        tmp_path, tiny_pixel_path, monkeypatch, capsys):
    """The device fills while step 2's checkpoint is written (torch's zip writer reports it
    without an errno): one message, the partial folder removed, step 1 stays the latest and the
    run resumes from it once there is space."""

    args = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=4", "trainer.save_freq=1", "trainer.total_training_steps=3")
    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        if "global_step_2.tmp" in str(path) and str(path).endswith("data.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    code, run = train_cli(tmp_path, tiny_pixel_path, *args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "no space left on the device" in err and "step-1 checkpoint is intact" in err, err
    ckpts = run / "checkpoints"
    assert (ckpts / POINTER).read_text() == "1" and sorted(p.name for p in ckpts.iterdir()) == [
        "global_step_1", POINTER]
    monkeypatch.setattr(torch, "save", real_save)
    code, _ = train_cli(tmp_path, tiny_pixel_path, *args)
    assert code == 0 and list_checkpoints(ckpts) == [1, 2, 3]


def test_too_little_space_for_the_next_checkpoint_is_named_before_writing(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    size = sum(p.stat().st_size for p in (tmp_path / "global_step_1").rglob("*") if p.is_file())
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=size))  # < 1.1 x the last one
    with pytest.raises(checkpointing.CheckpointError, match="step-1 checkpoint is intact and stays the latest"):
        _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", POINTER]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2 * size))
    _save(tmp_path, 2)
    assert list_checkpoints(tmp_path) == [1, 2]


def test_the_best_checkpoint_survives_rotation_and_its_pointer_names_it(tmp_path):
    best = BestCheckpoint(tmp_path, "val-core/overall/reward/mean@2")
    key = best.metric
    assert best.offer(0, {key: 0.9}) is False  # the base model has no checkpoint to keep
    for step, value in [(1, 0.3), (2, 0.5), (3, 0.4), (4, float("nan")), (5, 0.5)]:
        if best.offer(step, {key: value}) or step in (3, 4, 5):
            save_checkpoint(tmp_path, step, _fake_actor, {}, "config: 1", 1, best=best)
    # step 2 is the best (0.5; the later 0.5 does not beat it, NaN never does); max_keep=1 keeps
    # only the step just written and the best
    assert list_checkpoints(tmp_path) == [2, 5]
    assert json.loads((tmp_path / "best_checkpoint.json").read_text()) == {
        "metric": key, "step": 2, "value": 0.5, "folder": "global_step_2"}
    assert best_checkpoint_folder(tmp_path) == tmp_path / "global_step_2"
    # a resumed run compares against the best as of the checkpoint it resumes from
    resumed = BestCheckpoint(tmp_path, key)
    resumed.restore(tmp_path / "global_step_5")
    assert (resumed.step, resumed.value) == (2, 0.5)
    assert resumed.offer(6, {key: 0.45}) is False and resumed.offer(7, {key: 0.6}) is True
    other = BestCheckpoint(tmp_path, "val-core/overall/reward/best@2")  # another metric starts afresh
    other.restore(tmp_path / "global_step_5")
    assert other.step is None


def test_a_best_metric_the_validation_does_not_log_is_named(tmp_path):
    best = BestCheckpoint(tmp_path, "val-core/overall/reward/mean@4")
    with pytest.raises(ConfigError, match=r"trainer.best_metric.*val-core/overall/reward/mean@2"):
        best.offer(0, {"val-core/overall/reward/mean@2": 0.1, "rewards/mean": 0.2})
