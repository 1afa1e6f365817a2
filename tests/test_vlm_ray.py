"""The vision-language trainer on 2 Ray workers: ranks agree, and resume is exact under FSDP2."""

import numpy as np
import pytest

from conftest import vlm_config, vlm_run_killed_after_checkpoint


def _two_workers(strategy, *extra):
    return ("trainer.backend=ray", "trainer.n_workers=2", "trainer.num_cpus_per_worker=1",
            f"trainer.strategy={strategy}", "actor.lr=1e-3", "vlm.critic_lr=1e-3", *extra)


def _assert_ranks_agree(states):
    rank0, rank1 = states
    assert rank0.keys() == rank1.keys() and rank0
    for key in rank0:
        assert np.array_equal(rank0[key], rank1[key]), key


def test_ddp_ranks_hold_identical_weights_after_training(ray_cluster, tiny_vlm_path, tmp_path):
    from pixelrl.trainers.vlm_ppo import VLMPPOTrainer

    overrides = _two_workers("ddp", "model.lora_rank=4", "model.lora_alpha=8", "vlm.ptx_coef=0.1",
                             "trainer.total_training_steps=2", "vlm.estimator=rloo")
    result = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path, *overrides)).fit()
    _assert_ranks_agree(result["states"])
    # LoRA B starts at zero: a trained adapter has moved it on every rank alike
    assert any(np.abs(v).max() > 0 for k, v in result["states"][0].items() if "lora_B" in k)
    assert np.isfinite(result["history"][-1]["actor/pg_loss"])


def test_fsdp2_four_steps_equal_two_plus_two_bitwise(ray_cluster, tiny_vlm_path, tmp_path, monkeypatch):
    """Actor, critic, EMA, both optimizers and cosine schedulers, the adaptive KL controller: all
    sharded over 2 ranks, saved at step 2, the run killed, resumed, and equal to the uninterrupted run."""
    from pixelrl.trainers.vlm_ppo import VLMPPOTrainer

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
