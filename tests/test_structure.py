"""The seams of the package structure: the built-in extensions (shapes world, VLM trainer) reach
the lower registries only through registration, trainer types keep their former names as
aliases, and one `Schedule` decides when a loop validates, saves, dumps and stops."""

from __future__ import annotations

import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from pixelrl.config import load_config
from pixelrl.core.errors import ConfigError


def test_the_lower_layers_work_without_importing_the_built_in_extensions():
    """Importing the rewards, the config checks and the trainers loads neither pixelrl.shapes nor
    pixelrl.vlm, and a registry lookup never imports them: the entry points do (here the config
    loader, as the CLI and every worker's start-up)."""
    code = ("import sys\n"
            "import pixelrl.rewards, pixelrl.config, pixelrl.trainers.controller\n"
            "from pixelrl.core.errors import ConfigError\n"
            "from pixelrl.rewards import REWARDS, get_reward\n"
            "assert 'shapes_geneval' not in REWARDS\n"
            "try:\n"
            "    get_reward('shapes_geneval', exact_weight=1.0)\n"
            "    raise SystemExit('a lookup found an extension nobody imported')\n"
            "except ConfigError:\n"
            "    pass\n"
            "assert 'pixelrl.shapes' not in sys.modules and 'pixelrl.vlm' not in sys.modules, 'a lookup imported them'\n"
            "from pixelrl.config import load_config\n"
            "load_config('shapes_demo')\n"
            "fn = get_reward('shapes_geneval', exact_weight=1.0)\n"
            "from pixelrl.vlm.qa_tasks import QA_TASKS\n"
            "assert QA_TASKS.names() == ['files', 'shapes_qa'], QA_TASKS.names()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_unknown_question_task_lists_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"vlm.task.*'files', 'shapes_qa'"):
        load_config("vlm_grpo_shapes_qa", ["vlm.task=nope", f"trainer.default_local_dir={tmp_path}"])


@pytest.mark.parametrize("old, new", [("policy_gradient", "transition"), ("direct_preference", "forward_process")])
def test_a_former_trainer_type_runs_as_its_new_name_with_a_warning(old, new):
    config = "shapes_flow_grpo" if new == "transition" else "shapes_nft"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, [f"algorithm.trainer_type={old}"])
    assert cfg.algorithm.trainer_type == new
    assert any(issubclass(w.category, FutureWarning) and f"trainer_type={old}" in str(w.message)
               and new in str(w.message) for w in caught)


def test_a_checkpoint_saved_under_a_former_trainer_type_resumes(tmp_path):
    from pixelrl.config.sections import from_yaml_text
    from pixelrl.core.config_io import saved_yaml
    from pixelrl.trainers.checkpointing import check_resume_config

    cfg = load_config("shapes_nft")
    text = saved_yaml(cfg)
    (tmp_path / "config.yaml").write_text(text.replace("trainer_type: forward_process", "trainer_type: direct_preference"))
    assert "direct_preference" in (tmp_path / "config.yaml").read_text()
    assert check_resume_config(tmp_path, text) == []  # no refusal: the same type under its former name
    assert from_yaml_text((tmp_path / "config.yaml").read_text()).algorithm.trainer_type == "forward_process"
    with pytest.raises(ConfigError, match="algorithm.trainer_type"):  # another type is still refused
        check_resume_config(tmp_path, text.replace("trainer_type: forward_process", "trainer_type: transition"))


def _schedule(total=10, **trainer):
    from pixelrl.trainers.schedule import Schedule

    fields = dict(test_freq=3, save_freq=4, time_budget_s=0.0, rollout_data_dir=None, log_image_grid_every=0)
    return Schedule(SimpleNamespace(**{**fields, **trainer}), total)


def test_the_schedule_validates_and_saves_every_n_steps_and_at_the_last():
    s = _schedule()
    lasts = [s.finish_step(step, 1.0) for step in range(1, 11)]
    assert lasts == [False] * 9 + [True]
    assert [step for step in range(1, 11) if s.validates(step, step == 10)] == [3, 6, 9, 10]
    assert [step for step in range(1, 11) if s.saves(step, step == 10, False, None)] == [4, 8, 10]
    assert s.saves(5, False, True, None)  # a new best validation
    assert s.saves(5, False, False, RuntimeError("validation failed"))  # before the error ends the run
    never = _schedule(test_freq=-1, save_freq=-1)
    assert not never.validates(10, True) and not never.saves(10, True, False, RuntimeError("x"))
    only_last = _schedule(test_freq=0, save_freq=0)
    assert [step for step in range(1, 11) if only_last.validates(step, step == 10)] == [10]


def test_the_schedule_stops_when_the_time_budget_is_used():
    s = _schedule(total=100, time_budget_s=5.0)
    lasts = [s.finish_step(step, 2.0) for step in range(1, 4)]
    assert lasts == [False, False, True] and s.out_of_time and s.train_seconds == 6.0


def test_the_schedule_dumps_and_draws_grids_only_for_batches_when_asked():
    assert not _schedule().dumps_rollouts(True) and _schedule(rollout_data_dir="d").dumps_rollouts(True)
    assert not _schedule(rollout_data_dir="d").dumps_rollouts(False)  # a skipped step has no batch
    grids = _schedule(log_image_grid_every=2)
    assert [step for step in range(1, 7) if grids.draws_grid(step, True)] == [2, 4, 6]
    assert not grids.draws_grid(2, False) and not _schedule().draws_grid(2, True)


def test_a_window_schedule_checks_its_own_params():
    from pixelrl.sampling.windows import MixGRPOProgressiveParams, choose_window, window_params

    mix = ["rollout.sde_window_schedule=mixgrpo_progressive", "rollout.sde_window_size=3"]
    for bad, field in [("{stride: 0}", "rollout.sde_window_params.stride"),
                       ("{iters_per_group: 1.5}", "rollout.sde_window_params.iters_per_group"),
                       ("{rollback: 1}", "rollout.sde_window_params.rollback"),
                       ("{seed: 3}", "rollout.sde_window_params")]:  # mixgrpo_random's param, not this one's
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("shapes_flow_grpo", [*mix, f"rollout.sde_window_params={bad}"])
    with pytest.raises(ConfigError, match="no params|has no param"):
        window_params("random", {"stride": 2})
    assert window_params("mixgrpo_progressive", {"stride": 2}) == MixGRPOProgressiveParams(stride=2)
    # the params reach the schedule: stride 2, one step per group -> starts 0, 2, 4
    starts = [choose_window(10, 2, None, 0, schedule="mixgrpo_progressive", global_step=s,
                            params={"stride": 2, "iters_per_group": 1}).start for s in (1, 2, 3)]
    assert starts == [0, 2, 4]


def test_the_former_flat_window_keys_move_into_the_params_with_a_warning():
    from pixelrl.config.sections import from_yaml_text
    from pixelrl.core.config_io import saved_yaml

    mix = ["rollout.sde_window_schedule=mixgrpo_progressive", "rollout.sde_window_size=3"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config("shapes_flow_grpo", [*mix, "rollout.mixgrpo_stride=2", "rollout.mixgrpo_rollback=true"])
    assert cfg.rollout.sde_window_params == {"stride": 2, "rollback": True}
    assert sum("rollout.sde_window_params.stride" in str(w.message) for w in caught) == 1
    # a checkpoint's config saved before the move holds every flat key, defaults included
    old = saved_yaml(cfg).replace("sde_window_params:\n    stride: 2\n    rollback: true",
                                  "window_seed: 0\n  mixgrpo_stride: 2\n  mixgrpo_iters_per_group: 25\n"
                                  "  mixgrpo_rollback: true")
    assert "mixgrpo_stride: 2" in old and "sde_window_params" not in old
    assert from_yaml_text(old).rollout.sde_window_params == {"stride": 2, "rollback": True}


def test_the_old_policy_knobs_are_params_of_the_losses_that_keep_an_old_adapter():
    from pixelrl.algos.losses import LOSSES

    def bound(config, *overrides):
        cfg = load_config(config, list(overrides))
        return LOSSES.get(cfg.diffusion_loss.name).bind(cfg.diffusion_loss)

    awm, nft = bound("shapes_awm"), bound("shapes_nft")
    assert (awm.old_policy_schedule, awm.rollout_policy) == ("awm", "current")  # AWM's reference default
    assert (nft.old_policy_schedule, nft.rollout_policy) == ("linear_to_0_5", "old")
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params\.old_policy_decay"):
        bound("shapes_nft", "diffusion_loss.params.old_policy_schedule=constant", "diffusion_loss.params.old_policy_decay=1.5")
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params.*no param"):  # DPO keeps no old adapter
        bound("shapes_dpo", "diffusion_loss.params.rollout_policy=old")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = bound("shapes_nft", "algorithm.old_policy_update_interval=3")
    assert moved.old_policy_update_interval == 3
    assert any("diffusion_loss.params.old_policy_update_interval" in str(w.message) for w in caught)


def test_a_whole_group_loss_is_shuffled_by_groups_and_its_sizes_are_checked():
    """DGPO sums over each prompt group inside a micro-batch: the engine's shuffle moves groups as
    units, and the config refuses sizes that would split a group."""
    import torch

    from pixelrl.engine.objectives import whole_group_order

    uids = list("aaabbbcccddd")
    order = whole_group_order(uids, torch.Generator().manual_seed(3)).tolist()
    assert sorted(order) == list(range(12))
    chunks = [order[i:i + 3] for i in range(0, 12, 3)]
    assert all(len({uids[i] for i in chunk}) == 1 for chunk in chunks)  # every 3 rows: one whole group
    assert [uids[c[0]] for c in chunks] != list("abcd")  # and the groups themselves were shuffled
    base = ["diffusion_loss.name=dgpo", "algorithm.trainer_type=forward_process", "algorithm.drop_zero_advantage=false",
            "rollout.noise_level=0", "rollout.guidance_scale=1"]
    cfg = load_config("shapes_flow_grpo", base + ["actor.ppo_micro_batch_size=16"])
    assert cfg.diffusion_loss.name == "dgpo"
    # distinct timesteps the grid cannot hold: refused at start-up, not at the first update
    with pytest.raises(ConfigError, match=r"diffusion_loss\.params\.num_timesteps.*rollout.num_steps=3"):
        load_config("shapes_dgpo", ["rollout.num_steps=3"])
    for bad, field in [(["actor.ppo_micro_batch_size=12"], "actor.ppo_micro_batch_size"),
                       (["algorithm.drop_zero_advantage=true"], "algorithm.drop_zero_advantage"),
                       (["actor.ppo_mini_batch_size=24"], "actor.ppo_mini_batch_size"),
                       (["data.train_batch_size=3"], "data.train_batch_size")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("shapes_flow_grpo", base + ["actor.ppo_micro_batch_size=16", *bad])


def test_a_trainer_types_sections_are_its_own(tmp_path):
    """The vision-language section belongs to the vlm_ppo schema only: a diffusion config neither
    carries it nor accepts it, and a diffusion checkpoint saved while every config carried a
    `vlm:` section still reads."""
    from pixelrl.config.sections import PixelRLConfig, from_yaml_text
    from pixelrl.core.config_io import saved_yaml

    cfg = load_config("shapes_nft")
    assert type(cfg) is PixelRLConfig and not hasattr(cfg, "vlm")
    vlm = load_config("vlm_grpo_shapes_qa", [f"trainer.default_local_dir={tmp_path}"])
    assert vlm.vlm.task == "shapes_qa" and not isinstance(vlm, PixelRLConfig)  # a schema of its own
    with pytest.raises(ConfigError, match=r"`vlm`.*algorithm.trainer_type=vlm_ppo"):
        load_config("shapes_nft", ["vlm.kl_coef=0.1"])
    old = saved_yaml(cfg) + "vlm:\n  task: shapes_qa\n  kl_coef: 0.0\n"
    assert from_yaml_text(old) == cfg
    assert from_yaml_text(saved_yaml(vlm)).vlm == vlm.vlm


def test_each_section_checks_its_own_fields_without_the_rest_of_the_config():
    """A section's dataclass refuses its own bad values by itself (its `check()` beside its owner),
    so a new field's check goes where the field is read."""
    from pixelrl.algos.config import AlgorithmConfig, DiffusionLossConfig
    from pixelrl.config.sections import TrainerConfig, ValKwargs
    from pixelrl.data.config import DataConfig
    from pixelrl.engine.config import ActorConfig
    from pixelrl.models.config import ModelConfig
    from pixelrl.rewards.config import RewardConfig
    from pixelrl.sampling.config import RolloutConfig

    for section, field in [(ModelConfig(dtype="float12"), "model.dtype"),
                           (RolloutConfig(solver="dpm2"), "rollout.solver"),  # multistep with noise 0.7
                           (AlgorithmConfig(rollout_rs_lower=3.0, rollout_rs_upper=2.0), "algorithm.rollout_rs_lower"),
                           (DiffusionLossConfig(name="flow_grpo", clip_ratio=-1.0), "diffusion_loss.clip_ratio"),
                           (RewardConfig(functions=[{"name": "jpeg_compressibility", "weight": 0}]),
                            r"reward.functions\[\].weight"),
                           (DataConfig(prompts=["a cat", " "]), "data.prompts"),
                           (ActorConfig(betas=(0.9, 1.0)), "actor.betas"),
                           (TrainerConfig(backend="local", n_workers=2), "trainer.n_workers"),
                           (ValKwargs(rewards=[{"name": "jpeg_compressibility", "extra": 1}]), r"val_kwargs.rewards\[0\]")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            section.check()


def test_one_registry_of_method_families_names_every_trainer_type_objective_and_consumer():
    """`algos.methods.METHODS` is the list: each family has an engine objective and a consumer
    registered under its name, and at least one loss; every loss names a family; the config's
    trainer types are exactly the families and the separate trainers."""
    from pixelrl.algos.losses import LOSSES
    from pixelrl.algos.methods import METHODS
    from pixelrl.config.sections import SEPARATE_TRAINERS
    from pixelrl.engine.objectives import OBJECTIVES
    from pixelrl.trainers.consumers import CONSUMERS
    import pixelrl.trainers.controller  # noqa: F401  (imports every built-in consumer)

    families = set(METHODS.names())
    assert families == {"transition", "forward_process", "distribution_matching", "supervised"}
    assert set(OBJECTIVES.names()) == families and all(OBJECTIVES.get(n).name == n for n in families)
    assert set(CONSUMERS.names()) == families
    assert {LOSSES.get(n).objective for n in LOSSES.names()} == families
    assert not families & set(SEPARATE_TRAINERS.names())
