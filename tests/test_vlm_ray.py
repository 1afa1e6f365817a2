"""The vision-language trainer on 2 Ray workers: ranks agree, and resume is exact under FSDP2."""

import numpy as np
import pytest

from conftest import ray_actor_pids, vlm_config, vlm_run_killed_after_checkpoint


def _two_workers(strategy, *extra):
    return ("trainer.backend=ray", "trainer.n_workers=2", "trainer.num_cpus_per_worker=1",
            f"trainer.strategy={strategy}", "actor.lr=1e-3", "vlm.critic_lr=1e-3", *extra)


def _assert_ranks_agree(states):
    rank0, rank1 = states
    assert rank0.keys() == rank1.keys() and rank0
    for key in rank0:
        assert np.array_equal(rank0[key], rank1[key]), key


def test_ddp_ranks_hold_identical_weights_after_training(ray_cluster, tiny_vlm_path, tmp_path, ptx_file):
    from pixelrl.vlm.trainer import VLMPPOTrainer

    overrides = _two_workers("ddp", "model.lora_rank=4", "model.lora_alpha=8", "vlm.ptx_coef=0.1", f"vlm.ptx_files=[{ptx_file}]",
                             "trainer.total_training_steps=2", "vlm.estimator=rloo")
    result = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path, *overrides)).fit()
    _assert_ranks_agree(result["states"])
    # LoRA B starts at zero: a trained adapter has moved it on every rank alike
    assert any(np.abs(v).max() > 0 for k, v in result["states"][0].items() if "lora_B" in k)
    assert np.isfinite(result["history"][-1]["actor/pg_loss"])


# slow: in 2 of the project's full-suite CI runs (2026-11-25/26) a rank of this test's resumed run
# died of heap corruption in native code (glibc "unaligned tcache chunk" / SIGSEGV in malloc, in a
# Ray core-worker thread) ~5 s after it started; 20 runs of this test alone and one full suite on
# the same machine did not reproduce it (docs/algorithms/vlm_ppo.md, "Known issue")
@pytest.mark.slow
def test_fsdp2_four_steps_equal_two_plus_two_bitwise(ray_cluster, tiny_vlm_path, tmp_path, monkeypatch):
    """Actor, critic, EMA, both optimizers and cosine schedulers, the adaptive KL controller: all
    sharded over 2 ranks, saved at step 2, the run killed, resumed, and equal to the uninterrupted run."""
    from pixelrl.vlm.trainer import VLMPPOTrainer

    common = _two_workers("fsdp2", "vlm.estimator=gae", "vlm.ema_decay=0.9", "vlm.kl_coef=0.05",
                          "vlm.kl_target=0.01", "vlm.kl_horizon=100", "trainer.total_training_steps=4",
                          "trainer.save_freq=2")
    whole = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path / "a", *common)).fit()
    vlm_run_killed_after_checkpoint(vlm_config(tiny_vlm_path, tmp_path / "b", *common), monkeypatch, 2)
    resumed = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path / "b", *common)).fit()
    assert len(resumed["history"]) == 2
    _assert_ranks_agree(whole["states"])
    _assert_ranks_agree(resumed["states"])
    a, b = whole["states"][0], resumed["states"][0]
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    # the resumed half trained: non-zero gradients, and a learning rate still above the cosine's
    # floor of 0 after step 3 (it reaches 0 with the run's last optimizer step)
    assert all(row["actor/grad_norm"] > 0 for row in resumed["history"])
    assert resumed["history"][0]["actor/lr"] > 0 == resumed["history"][-1]["actor/lr"]
    assert whole["history"][-1]["actor/kl_coef"] == resumed["history"][-1]["actor/kl_coef"]
    assert whole["history"][-1]["critic/value_loss"] == resumed["history"][-1]["critic/value_loss"]


@pytest.mark.parametrize("family, layer, block, tower", [
    ("qwen2_vl", "Qwen2VLDecoderLayer", "Qwen2VLVisionBlock", "Qwen2VisionTransformerPretrainedModel"),
    # ~9 s; Qwen2-VL in the default run, Qwen2.5-VL's same layout with `pytest -m slow`
    pytest.param("qwen2_5_vl", "Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock",
                 "Qwen2_5_VisionTransformerPretrainedModel", marks=pytest.mark.slow),
])
def test_fsdp2_shards_actor_and_critic_per_block_and_both_train(ray_cluster, request, tmp_path, family, layer, block,
                                                                 tower):
    """Under FSDP2 each decoder layer, vision block and the vision tower is its own all-gather unit
    in the actor and in the critic, on both ranks; two steps of synchronised generation (every rank
    runs the same forwards) and training move the actor and the critic, the same on both ranks.
    Qwen2-VL runs in bf16, as on GPUs: float32 master weights gathered in bf16."""
    import json

    from pixelrl.core.config_io import to_yaml
    from pixelrl.workers.group import RayWorkerGroup
    from pixelrl.vlm.worker import VLMWorker

    path = request.getfixturevalue("tiny_vlm_path" if family == "qwen2_vl" else "tiny_vlm25_path")
    dtype = "bfloat16" if family == "qwen2_vl" else "float32"
    cfg = vlm_config(path, tmp_path, *_two_workers("fsdp2", "vlm.estimator=gae", "vlm.ema_decay=0.9",
                                                   f"model.dtype={dtype}"))
    group = RayWorkerGroup(to_yaml(cfg), 2, 1, worker_cls=VLMWorker)
    try:
        units = group.call("fsdp_units", gather="all")
        start = group.trainable_states()[0]
        metrics = [group.call("train_step", None, step, gather="mean") for step in (1, 2)]
        rank0, rank1 = group.trainable_states()
    finally:
        group.shutdown()
    config = json.loads((path / "config.json").read_text())
    layers = config.get("text_config", config)["num_hidden_layers"]
    blocks = config["vision_config"]["depth"]
    assert units[0] == units[1]
    for part in ("actor", "critic"):
        names = units[0][part]
        assert names.count(layer) == layers and names.count(block) == blocks, names
        assert names.count(tower) == 1 and len(names) == layers + blocks + 2, names
    _assert_ranks_agree([rank0, rank1])
    for part in ("actor/", "critic/"):
        assert any(not np.array_equal(rank0[k], start[k]) for k in rank0 if k.startswith(part)), part
    assert all(np.isfinite(m["critic/value_loss"]) and m["actor/grad_norm"] > 0 for m in metrics)


@pytest.mark.slow  # the default run restarts a Flow-GRPO run (test_runtime_ray.py): the same outer loop
def test_a_worker_that_dies_is_restarted_and_the_run_ends_as_an_uninterrupted_one(ray_cluster, tiny_vlm_path,
                                                                                    tmp_path, monkeypatch, capsys):
    """`trainer.max_restarts=1`: right after the step-2 checkpoint one worker's process dies of a
    SIGSEGV; the run starts its workers again, resumes from step 2, and its weights after step 4
    equal those of a run that was never interrupted."""
    import os
    import signal

    import pixelrl.vlm.trainer as vlm_ppo
    from pixelrl.trainers.restarts import fit_with_restarts

    common = _two_workers("ddp", "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_restarts=1")
    whole = fit_with_restarts(vlm_config(tiny_vlm_path, tmp_path / "a", *common))
    already_running = ray_actor_pids("VLMWorker")
    save, crashed = vlm_ppo.save_checkpoint, []

    def save_then_crash_a_worker(root, at, *args, **kwargs):
        folder = save(root, at, *args, **kwargs)
        if at == 2 and not crashed:
            crashed.append(max(ray_actor_pids("VLMWorker") - already_running))
            os.kill(crashed[0], signal.SIGSEGV)
        return folder

    monkeypatch.setattr(vlm_ppo, "save_checkpoint", save_then_crash_a_worker)
    restarted = fit_with_restarts(vlm_config(tiny_vlm_path, tmp_path / "b", *common))
    assert crashed and "restart 1 of 1" in capsys.readouterr().out
    assert len(restarted["history"]) == 2  # steps 3 and 4, after the resume from step 2
    for key in whole["states"][0]:
        assert np.array_equal(whole["states"][0][key], restarted["states"][0][key]), key
