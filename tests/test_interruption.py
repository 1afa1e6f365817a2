"""An interrupted or restarted run says what it kept: the checkpoint a restart resumes from and
the steps it trains again, or that there is none and where it starts."""

import json

import pytest
from conftest import train_cli

from pixelrl.trainers.checkpointing import POINTER
from pixelrl.trainers.run_folder import interruption_summary, start_over_notice


def _logged(run_dir, steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in steps))


def test_an_interruption_without_a_checkpoint_says_every_step_is_lost(tmp_path):
    """Ctrl-C said `the last complete checkpoint is intact` when there was none (save_freq 0)."""
    _logged(tmp_path, range(1, 12))
    assert interruption_summary(tmp_path, 0) == (
        "no checkpoint was written (trainer.save_freq=0 saves only at the last step): the 11 step(s) trained are "
        "lost, and a restart starts over at step 1")
    assert "saves every 5 steps" in interruption_summary(tmp_path, 5)


def test_an_interruption_after_a_checkpoint_names_it_and_the_steps_to_train_again(tmp_path):
    _logged(tmp_path, range(1, 7))
    (tmp_path / "checkpoints" / "global_step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "global_step_4" / "trainer_state.json").write_text('{"global_step": 4}')
    (tmp_path / "checkpoints" / POINTER).write_text("4")
    summary = interruption_summary(tmp_path, 4)
    assert summary.endswith("global_step_4 (step 4 of the 6 trained): a restart resumes there; steps 5..6 will "
                            "train again")


def test_ctrl_c_in_train_prints_what_the_run_folder_kept(tmp_path, tiny_sd3_path, monkeypatch, capsys):
    from pixelrl.trainers import restarts

    def interrupted(cfg, console=print):
        _logged(tmp_path / "pixelrl" / "flow_grpo_tiny", range(1, 4))
        raise KeyboardInterrupt

    monkeypatch.setattr(restarts, "fit_with_restarts", interrupted)
    code, _ = train_cli(tmp_path, tiny_sd3_path, "trainer.backend=local")
    assert code == 130
    assert "interrupted; no checkpoint was written (trainer.save_freq=0 saves only at the last step): the 3 " \
           "step(s) trained are lost" in capsys.readouterr().err


def test_a_restart_without_a_checkpoint_says_it_starts_over(tmp_path, tiny_sd3_path, capsys):
    """A run that never saved, started again: it says it begins at step 1 and replaces the rows
    (it began silently at step 1 and dropped them)."""
    args = ("trainer.backend=local", "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.logger=[console,jsonl]")
    assert train_cli(tmp_path, tiny_sd3_path, *args)[0] == 0
    assert "starting over" not in capsys.readouterr().out
    code, run = train_cli(tmp_path, tiny_sd3_path, *args)
    assert code == 0
    assert f"no checkpoint to resume in {run / 'checkpoints'}: starting over at step 1; the earlier run's " \
           "metrics (to step 2) are replaced" in capsys.readouterr().out
    assert start_over_notice(tmp_path / "elsewhere") is None


def _scripted_trainers(monkeypatch, root, attempts):
    """`fit_with_restarts` over trainers whose fit() plays `attempts` in turn: an exception to raise
    or a result to return, each after writing a checkpoint pointer into `root` when the entry says
    so. Returns the resume_mode each attempt started with."""
    from pixelrl.trainers import restarts

    started = []

    class Scripted:
        def __init__(self, cfg, console=print):
            self.cfg, self.ckpt_root = cfg, root
            started.append(cfg.trainer.resume_mode)

        def fit(self):
            outcome, writes_checkpoint = attempts[len(started) - 1]
            if writes_checkpoint:
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                (self.ckpt_root / POINTER).write_text(str(len(started)))
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

    monkeypatch.setattr(restarts, "trainer_class", lambda cfg: Scripted)
    return started


def test_a_dead_worker_restarts_the_run_from_its_checkpoint_and_an_exception_does_not(tmp_path, monkeypatch,
                                                                                       tiny_sd3_path):
    """The outer loop of `trainer.max_restarts`: a process death starts the trainer again, resuming
    (resume_mode auto) only where the failed attempt wrote a checkpoint, at most max_restarts times;
    a worker's exception is raised at once (it would repeat)."""
    from pixelrl.config import load_config
    from pixelrl.trainers.restarts import fit_with_restarts
    from pixelrl.workers.group import WorkerDiedError

    cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "trainer.backend=ray",
                                         "trainer.max_restarts=2", "trainer.resume_mode=disable"])
    died = WorkerDiedError("actor worker rank 1 (pid 7) failed", process_died=True)
    lines = []
    started = _scripted_trainers(monkeypatch, tmp_path / "a", [(died, False), (died, True), ({"done": 1}, False)])
    assert fit_with_restarts(cfg, console=lines.append) == {"done": 1}
    # no checkpoint after the first death: started as before; after the second: resumed from it
    assert started == ["disable", "disable", "auto"]
    assert lines[0].startswith("restart 1 of 2: actor worker rank 1") and "where it started" in lines[0]
    assert lines[1].startswith("restart 2 of 2:") and "from its latest checkpoint" in lines[1]

    started = _scripted_trainers(monkeypatch, tmp_path / "b", [(died, True)] * 3)
    with pytest.raises(WorkerDiedError):
        fit_with_restarts(cfg, console=lines.append)
    assert len(started) == 3  # the first attempt and max_restarts=2 more

    raised = WorkerDiedError("actor worker rank 0 raised ValueError", process_died=False)
    started = _scripted_trainers(monkeypatch, tmp_path / "c", [(raised, True), ({"done": 1}, False)])
    with pytest.raises(WorkerDiedError, match="raised ValueError"):
        fit_with_restarts(cfg, console=lines.append)
    assert started == ["disable"]
