"""The vision-language trainer's schema: only the fields its trainer reads, LightRFT's defaults,
and checkpoints saved while its config carried every diffusion field."""

import math
from dataclasses import fields, is_dataclass

import pytest
import torch
from conftest import vlm_config

from pixelrl.config.sections import PixelRLConfig, from_yaml_text, merge_config
from pixelrl.core.config_io import to_yaml
from pixelrl.core.errors import ConfigError


def _leaves(schema, prefix=""):
    from typing import get_type_hints

    hints = get_type_hints(schema)
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_a_vlm_config_carries_no_diffusion_section_or_field():
    cfg = merge_config("vlm_grpo_shapes_qa")
    leaves = set(_leaves(type(cfg)))
    diffusion_only = set(_leaves(PixelRLConfig)) - leaves
    assert not {leaf.split(".")[0] for leaf in leaves} & {"diffusion_loss", "val_kwargs"}
    for field in ("rollout.num_steps", "rollout.guidance_scale", "actor.ema_decay", "actor.timestep_fraction",
                  "model.compile", "model.max_sequence_length", "reward.placement", "reward.on_error",
                  "trainer.mode", "trainer.fit_to_memory_gb", "data.source_weights", "data.prompts",
                  "algorithm.adv_estimator", "diffusion_loss.kl_coef"):
        assert field in diffusion_only, field
    assert len(leaves) < 100  # was 121 diffusion fields + the vlm section


@pytest.mark.parametrize("override, field", [
    ("diffusion_loss.kl_coef=0.5", "diffusion_loss.kl_coef"),  # did nothing and said nothing before
    ("rollout.guidance_scale=3", "rollout.guidance_scale"),
    ("val_kwargs.n=4", "val_kwargs.n"),
    ("trainer.rollout_data_dir=/tmp/x", "trainer.rollout_data_dir"),
    ("algorithm.drop_zero_advantage=false", "algorithm.drop_zero_advantage"),
])
def test_a_diffusion_field_in_a_vlm_config_is_refused_by_name(override, field):
    with pytest.raises(ConfigError, match=rf"`{field}` = .*read by the diffusion trainers only"):
        merge_config("vlm_grpo_shapes_qa", [override])


def test_a_vlm_field_in_a_diffusion_config_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"`vlm` .*algorithm.trainer_type=vlm_ppo"):
        merge_config("shapes_demo", ["vlm.kl_coef=0.1"])


def test_an_unknown_vlm_key_is_still_an_unknown_key():
    with pytest.raises(ConfigError, match=r"`actor\.lrr` .*unknown key"):
        merge_config("vlm_grpo_shapes_qa", ["actor.lrr=1"])


def test_the_vlm_defaults_are_lightrfts():
    """LightRFT's GRPO / PPO scripts: Adam betas (0.9, 0.95), cosine_with_min_lr to 0.1 lr after a
    warm-up of 3% of the steps, critic lr 9e-6, LoRA alpha 16 on every linear layer, the vision
    tower frozen."""
    from pixelrl.vlm.config import VLMRunConfig

    cfg = VLMRunConfig()
    assert tuple(cfg.actor.betas) == (0.9, 0.95)
    assert (cfg.actor.lr_schedule, cfg.actor.min_lr_ratio, cfg.actor.warmup_ratio) == ("cosine", 0.1, 0.03)
    assert cfg.vlm.critic_lr == 9e-6 and cfg.vlm.freeze_vision_tower
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules) == (0, 16.0, None)


def test_a_warmup_ratio_warms_up_over_its_share_then_decays_to_the_floor():
    """cosine_with_min_lr: 100 optimizer steps at ratio 0.03 warm up over ceil(3) steps, then the
    half cosine ends at 0.1 lr."""
    from pixelrl.engine.learner import Learner
    from pixelrl.vlm.config import VLMActorConfig

    learner = Learner.from_actor_config(lambda: [torch.nn.Parameter(torch.zeros(1))], VLMActorConfig(lr=1.0),
                                        total_steps=100)
    assert learner.warmup_steps == 3
    assert [learner.lr_factor(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert learner.lr_factor(3) == pytest.approx(1.0)
    midway = 3 + 97 / 2
    assert learner.lr_factor(midway) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learner.lr_factor(100) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"actor\.warmup_ratio"):
        VLMActorConfig(warmup_ratio=0.03, warmup_steps=5).check()


def test_the_vision_tower_is_frozen_and_lora_covers_every_linear_layer(tiny_vlm_path, tmp_path):
    from pixelrl.vlm.engine import VLMEngine

    full = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, "vlm.freeze_vision_tower=true"))
    visual = {id(p) for p in full.policy.vision_tower().parameters()}
    assert visual and not visual & {id(p) for p in full.trainable}
    assert len(full.trainable) == sum(1 for p in full.policy.model.parameters()) - len(visual)
    lora = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, "model.lora_rank=4"))
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in lora.policy.model.named_parameters()
               if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("visual" in name for name, p in lora.policy.model.named_parameters() if p.requires_grad)


def test_the_critic_follows_the_actors_schedule_at_its_own_lr(tiny_vlm_path, tmp_path):
    from pixelrl.vlm.engine import VLMEngine

    engine = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, "vlm.estimator=gae", "vlm.critic_lr=1e-3",
                                  "actor.min_lr_ratio=0.1", "trainer.total_training_steps=5"))
    critic = engine.critic_learner
    assert (critic.lr, critic.schedule, critic.min_lr_ratio, critic.total_steps) == (1e-3, "cosine", 0.1, 10)


def test_a_checkpoint_saved_with_every_diffusion_field_reads_as_it_trained(tiny_vlm_path, tmp_path):
    """A vision-language config saved before its own schema: the diffusion sections' defaults and
    the vlm section. It reads back with the values it held, and where today's defaults changed
    (warm-up, vision tower, LoRA targets) with what it trained with."""
    from omegaconf import OmegaConf

    now = vlm_config(tiny_vlm_path, tmp_path, "model.lora_rank=4")
    old = OmegaConf.merge(OmegaConf.create(to_yaml(PixelRLConfig())), OmegaConf.create(to_yaml(now)))
    for key in ("actor.warmup_ratio", "vlm.freeze_vision_tower"):  # fields the old schema did not have
        section, leaf = key.split(".")
        old[section].pop(leaf)
    OmegaConf.update(old, "model.lora_target_modules", None)
    old.actor.betas = [0.9, 0.999]
    read = from_yaml_text(OmegaConf.to_yaml(old))
    assert type(read) is type(now)
    assert read.actor.warmup_ratio == 0.0 and read.vlm.freeze_vision_tower is False
    assert read.model.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert tuple(read.actor.betas) == (0.9, 0.999) and read.model.lora_rank == 4
    assert read.vlm == now.vlm.__class__(**{**now.vlm.__dict__, "freeze_vision_tower": False})
    # today's saved config reads back unchanged
    assert to_yaml(from_yaml_text(to_yaml(now))) == to_yaml(now)
