"""Sampling ahead on a separate rollout pool (trainer.mode sync / one_step_off / async), in one
process: the fixed schedule, its equality with the synchronous trainer, stale-batch correction,
and resume with batches in flight (including after kill -9)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, train_cli

LOCAL = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=4")
POOL = ("rollout.n_workers=1",)


def _weights(run, step):
    return load_file(str(run / "checkpoints" / f"global_step_{step}" / "actor" / "trainable.safetensors"))


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zero_staleness_on_a_rollout_pool_reproduces_the_synchronous_trainer_bitwise(tmp_path, tiny_pixel_path):
    steps = ("trainer.total_training_steps=3",)
    code, colocated = train_cli(tmp_path / "colocated", tiny_pixel_path, *LOCAL, *steps)
    assert code == 0
    code, pooled = train_cli(tmp_path / "pooled", tiny_pixel_path, *LOCAL, *steps, *POOL, "trainer.mode=async",
                             "trainer.max_staleness=0")
    assert code == 0
    a, b = read_metrics(colocated), read_metrics(pooled)
    assert [m["critic/rewards/mean"] for m in a] == [m["critic/rewards/mean"] for m in b]
    assert all(m["training/staleness"] == 0 and m["training/policy_versions_behind"] == 0 for m in b)
    assert _same_weights(_weights(colocated, 3), _weights(pooled, 3))
    # the pool's batches were sampled by its own worker, then scored; colocated, phases take turns
    assert all(m["timeline/gen_start"] < m["timeline/gen_end"] <= m["timeline/reward_end"] for m in b)
    assert all(m["timeline/gen_start"] < m["timeline/gen_end"] <= m["timeline/reward_start"] < m["timeline/reward_end"]
               <= m["timeline/train_start"] < m["timeline/train_end"] for m in a)


def test_one_step_off_samples_with_weights_one_step_old_and_corrects_them(tmp_path, tiny_pixel_path):
    steps = ("trainer.total_training_steps=4",)
    code, sync = train_cli(tmp_path / "sync", tiny_pixel_path, *LOCAL, *steps)
    assert code == 0
    code, off = train_cli(tmp_path / "off", tiny_pixel_path, *LOCAL, *steps, *POOL, "trainer.mode=one_step_off")
    assert code == 0
    metrics = read_metrics(off)
    # batch 1 and 2 come from the initial weights, batch i from those after step i - 2
    assert [m["training/staleness"] for m in metrics] == [0, 1, 1, 1]
    assert metrics[0]["training/policy_versions_behind"] == 0
    assert all(m["training/policy_versions_behind"] == 2 for m in metrics[1:])  # 2 optimizer steps a step
    # a stale batch is re-scored under the current weights and importance-weighted; a fresh one not
    assert "rollout_corr/is_weight_mean" not in metrics[0]
    assert all(m["rollout_corr/logp_abs_diff_mean"] > 0 for m in metrics[1:])
    # batch 2 was sampled with the weights that sampled batch 1, so it differs from sync's batch 2
    synced = read_metrics(sync)
    assert metrics[0]["critic/rewards/mean"] == synced[0]["critic/rewards/mean"]
    assert metrics[1]["critic/rewards/mean"] != synced[1]["critic/rewards/mean"]


# one_step_off is async with max_staleness 1 and the same queue: the default run kills async_k2
@pytest.mark.parametrize("mode", [pytest.param(("trainer.mode=one_step_off",), marks=pytest.mark.slow),
                                  ("trainer.mode=async", "trainer.max_staleness=2")],
                         ids=["one_step_off", "async_k2"])
def test_kill_9_mid_step_then_resume_finishes_with_the_weights_of_an_uninterrupted_run(tmp_path, tiny_pixel_path,
                                                                                         mode):
    total = 6
    args = (*LOCAL, *POOL, *mode, f"trainer.total_training_steps={total}", "trainer.save_freq=1")
    code, straight = train_cli(tmp_path / "straight", tiny_pixel_path, *args)
    assert code == 0

    killed_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "pixelrl", "train", "--config-name", "flow_grpo_tiny",
               f"model.path={tiny_pixel_path}", f"trainer.default_local_dir={killed_dir}",
               "trainer.num_cpus_per_worker=1", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = killed_dir / "pixelrl" / "flow_grpo_tiny" / "checkpoints"
    pointer = root / "latest_checkpointed_iteration.txt"

    def saved() -> int:  # the step of the latest complete checkpoint (the pointer is written last)
        try:
            return int(pointer.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    deadline = time.time() + 120
    while saved() < 3 and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.15)  # into step 4 (a step takes about half a second here)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    latest = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= latest < total  # killed in the middle of the run
    queued = sorted(p.name for p in (root / f"global_step_{latest}" / "rollout_queue").glob("*.json"))
    assert queued == [f"step_{s}.json" for s in range(latest + 1, min(total, latest + (2 if "max_staleness=2" in mode[-1] else 1)) + 1)]

    code, _ = train_cli(killed_dir, tiny_pixel_path, *args)
    assert code == 0
    assert _same_weights(_weights(straight, total), _weights(killed_dir / "pixelrl" / "flow_grpo_tiny", total))
    rewards = [m["critic/rewards/mean"] for m in read_metrics(straight)]
    resumed = {m["training/global_step"]: m["critic/rewards/mean"]
               for m in read_metrics(killed_dir / "pixelrl" / "flow_grpo_tiny")}
    assert [resumed[s] for s in range(1, total + 1)] == rewards  # no prompt group lost or repeated


def test_modes_that_sample_ahead_need_a_pool_and_a_transition_loss(tmp_path, tiny_pixel_path, capsys):
    code, _ = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "trainer.mode=one_step_off")
    assert code == 2 and "rollout.n_workers" in capsys.readouterr().err
    code, _ = train_cli(tmp_path, tiny_pixel_path, *LOCAL, *POOL, config="nft_tiny")
    assert code == 2 and "rollout.n_workers" in capsys.readouterr().err
    code, _ = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "trainer.mode=later")
    assert code == 2 and "trainer.mode" in capsys.readouterr().err


RAY = ("trainer.logger=[jsonl]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.save_freq=-1")


@pytest.mark.slow  # ~30 s; the default run has the same bitwise check on in-process pools (test_zero_staleness_on_a_rollout_pool_...)
def test_zero_staleness_on_a_ray_rollout_pool_reproduces_the_ray_synchronous_trainer_bitwise(ray_cluster, tmp_path,
                                                                                             tiny_pixel_path):
    steps = ("trainer.total_training_steps=3", "trainer.save_freq=3")
    code, colocated = train_cli(tmp_path / "colocated", tiny_pixel_path, *RAY, *steps)
    assert code == 0
    code, pooled = train_cli(tmp_path / "pooled", tiny_pixel_path, *RAY, *steps, *POOL, "trainer.mode=async",
                             "trainer.max_staleness=0", "rollout.num_cpus_per_worker=1")
    assert code == 0
    a, b = read_metrics(colocated), read_metrics(pooled)
    assert [m["critic/rewards/mean"] for m in a] == [m["critic/rewards/mean"] for m in b]
    assert all(m["training/staleness"] == 0 for m in b)
    assert _same_weights(_weights(colocated, 3), _weights(pooled, 3))


@pytest.mark.slow  # ~20 s of timing; the one-step-off schedule itself is checked in the default run above
def test_a_slow_reward_is_scored_while_the_actor_trains_in_one_step_off_mode(ray_cluster, tmp_path, tiny_pixel_path):
    """Scoring batch i + 1 (a reward that waits 0.1 s per image, like a remote scorer) overlaps
    training on batch i; in the synchronous loop it cannot."""
    slow = "reward.functions=[{name: delayed, weight: 1.0, options: {seconds_per_image: 0.1}}]"
    code, run = train_cli(tmp_path, tiny_pixel_path, *RAY, *POOL, slow, "trainer.mode=one_step_off",
                          "rollout.num_cpus_per_worker=1", "trainer.total_training_steps=4")
    assert code == 0
    m = read_metrics(run)
    assert all(r["timeline/reward_end"] - r["timeline/reward_start"] >= 0.8 for r in m)  # 8 images
    assert all(r["timeline/reward_end"] <= r["timeline/train_start"] for r in m)  # a batch is scored before training
    overlaps = [min(m[j]["timeline/train_end"], m[j + 1]["timeline/reward_end"])
                - max(m[j]["timeline/train_start"], m[j + 1]["timeline/reward_start"]) for j in range(1, 3)]
    assert all(o > 0 for o in overlaps), overlaps
