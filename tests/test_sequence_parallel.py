"""Sequence parallelism (trainer.sequence_parallel_size): a Wan run whose every sample's tokens are
split over two ranks (Ulysses) trains as one rank holding whole samples does; bad sizes are
refused by name."""

import numpy as np
import pytest
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.parallel.group import Mesh

# what a step computes from the samples and the gradient (not the metrics that measure float noise)
COMPARED = ("critic/rewards/mean", "actor/pg_loss", "actor/policy_loss", "actor/grad_norm")
WAN = ("model.type=wan", "model.max_sequence_length=16", "model.num_frames=5", "rollout.guidance_scale=1.0")


def _train_one_step(group, cfg, rewards, step_fn, save_to=None):
    prompts = ["a red circle", "two blue squares"]
    try:
        _, metrics = step_fn(group, rewards, prompts, [{}] * len(prompts), 1, cfg, uids=list("ab"),
                             num_workers=group.data_size)
        if save_to is not None:
            group.save(str(save_to))
        return group.trainable_states(), {k: metrics[k] for k in COMPARED if k in metrics}
    finally:
        group.shutdown()


@pytest.mark.parametrize("recipe, strategy", [("flow_grpo_tiny", "ddp"), ("nft_tiny", "ddp"),
                                              pytest.param("flow_grpo_tiny", "fsdp2", marks=pytest.mark.slow)])
def test_two_sequence_ranks_train_as_one_rank_holding_whole_samples(ray_cluster, tiny_wan_path, tmp_path, recipe,
                                                                    strategy):
    """Two workers at sequence_parallel_size 2 hold the same two prompts' samples, each rank a half
    of every sample's video tokens. The forward is one rank's arithmetic reordered by heads (the
    samples, the loss and the reward are equal to float32 rounding) and the gradient the sum of
    the two halves' (summation order only). Adam's epsilon is set far above the gradients, so the
    update is lr x the gradient and the weights compare the gradients themselves (AdamW's first
    step is near lr x sign(g), which turns summation-order noise in a gradient element near zero
    into a whole step). After the update both ranks hold the same weights, equal to one worker's
    to 1e-4 of how far they moved; the checkpoint they write loads into one worker as those
    weights. One update only: a second step samples with the updated weights, where a near tie
    between two samples' rewards can amplify float noise (seen with torch's default CPU kernels)."""
    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.testing import forward_process_step, transition_step
    from pixelrl.workers.group import RayWorkerGroup, RewardGroup

    overrides = [f"model.path={tiny_wan_path}", *WAN, "actor.lr=10", "actor.adam_eps=1.0", "data.train_batch_size=2", "rollout.n=2",
                 "actor.ppo_mini_batch_size=0", "actor.ppo_micro_batch_size=2"]
    if recipe == "flow_grpo_tiny":
        overrides.append("algorithm.drop_zero_advantage=false")
    sp = load_config(recipe, [*overrides, "trainer.n_workers=2", "trainer.sequence_parallel_size=2",
                              f"trainer.strategy={strategy}"])
    one = load_config(recipe, overrides)
    step_fn = transition_step if recipe == "flow_grpo_tiny" else forward_process_step
    rewards = RewardGroup([dict(f) for f in sp.reward.functions], backend="local")

    group = RayWorkerGroup(to_yaml(sp), 2, 1, sequence_size=2)
    assert group.data_size == 1
    (rank0, rank1), sp_step = _train_one_step(group, sp, rewards, step_fn, save_to=tmp_path / "sp2")
    # one Ray worker: the same threads per worker, so float kernels differ only by the split
    (single,), one_step = _train_one_step(RayWorkerGroup(to_yaml(one), 1, 1), one, rewards, step_fn)
    assert rank0.keys() == rank1.keys() == single.keys()
    assert all(np.array_equal(rank0[k], rank1[k]) for k in rank0)
    assert sp_step == pytest.approx(one_step, rel=1e-6, abs=1e-9)
    moved = max(float(np.abs(single[k]).max()) for k in single if "lora_B" in k)
    assert moved > 1e-4  # the updates did move the adapter ...
    worst = max(float(np.abs(rank0[k] - single[k]).max()) for k in single)
    assert worst < 1e-4 * moved  # ... and the split run moved it the same way
    resumed = RayWorkerGroup(to_yaml(one), 1, 1)
    try:
        resumed.load(str(tmp_path / "sp2"))
        (loaded,) = resumed.trainable_states()
    finally:
        resumed.shutdown()
    assert all(np.array_equal(loaded[k], rank0[k]) for k in rank0)  # saved at 2 ranks per sample, read at 1


def test_the_mesh_reduces_over_data_ranks_and_sums_over_a_sequence_group():
    """Ranks are laid out data-major with the sequence innermost; a gradient is averaged over the
    data ranks only (a sequence group's ranks each hold a part of the same rows' gradient)."""
    mesh = Mesh(world_size=6, rank=4, sequence_size=3)
    assert (mesh.data_size, mesh.data_rank) == (2, 1)
    with pytest.raises(ValueError, match="sequence groups of 4"):
        Mesh(world_size=6, sequence_size=4)


@pytest.mark.parametrize("overrides, field, says", [
    (["trainer.n_workers=3", "trainer.sequence_parallel_size=2"], "trainer.sequence_parallel_size",
     "divides trainer.n_workers=3"),
    (["trainer.n_workers=4", "trainer.sequence_parallel_size=4"], "trainer.sequence_parallel_size",
     "2 attention heads"),
    (["trainer.n_workers=2", "trainer.sequence_parallel_size=2", "model.compile=true"],
     "trainer.sequence_parallel_size", "compile"),
    (["trainer.n_workers=2", "trainer.sequence_parallel_size=0"], "trainer.sequence_parallel_size", ""),
])
def test_a_sequence_split_the_model_cannot_take_is_refused_by_name(tiny_wan_path, overrides, field, says):
    from pixelrl.config import load_config

    with pytest.raises(ConfigError, match=says) as err:
        load_config("flow_grpo_tiny", [f"model.path={tiny_wan_path}", *WAN, "data.train_batch_size=4", *overrides])
    assert err.value.field == field


def test_a_family_without_a_sequence_split_is_refused(tiny_pixel_path):
    from pixelrl.config import load_config

    with pytest.raises(ConfigError, match="sd3") as err:
        load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "trainer.n_workers=2",
                                       "trainer.sequence_parallel_size=2"])
    assert err.value.field == "trainer.sequence_parallel_size"


def test_a_token_count_the_group_cannot_split_evenly_is_refused_naming_the_size():
    """The split point checks the whole sequence first: diffusers' own check is an assert."""
    from pixelrl.parallel.sequence import check_even_split

    check_even_split(192, Mesh(world_size=2, sequence_size=2), "rollout.resolution")
    with pytest.raises(ConfigError, match="75 tokens") as err:
        check_even_split(75, Mesh(world_size=2, sequence_size=2), "rollout.resolution")
    assert err.value.field == "trainer.sequence_parallel_size"
    assert "rollout.resolution" in str(err.value)
