"""The EMA of the trained weights (actor.ema_decay): flow_grpo's and DiffusionNFT's `train.ema`.
Its decay schedule by hand, the engine's update and swap, checkpoints, validation and export."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import train_cli
from pixelrl.engine.weights_ema import WeightsEMA, warmed_up_decay

LOCAL = ("trainer.backend=local", "trainer.logger=[jsonl]")


def test_decay_warms_up_to_its_ceiling_like_the_references():
    # min((1 + s) / (10 + s), 0.9): 2/11 after the first optimizer step, 0.9 from s = 80 on
    assert warmed_up_decay(1, 0.9) == pytest.approx(2 / 11)
    assert warmed_up_decay(7, 0.9) == pytest.approx(8 / 17)
    assert warmed_up_decay(80, 0.9) == pytest.approx(0.9)
    assert warmed_up_decay(1000, 0.9) == pytest.approx(0.9)


def test_ema_updates_by_hand_and_only_on_its_interval():
    param = torch.zeros(2)
    ema = WeightsEMA([param], decay=0.9, update_interval=1)
    param.fill_(1.0)
    assert ema.update(1) == pytest.approx(2 / 11)
    assert ema.values[0].tolist() == pytest.approx([9 / 11, 9 / 11])  # 2/11 * 0 + 9/11 * 1
    param.fill_(3.0)
    ema.update(2)  # decay 3/12: 0.25 * 9/11 + 0.75 * 3
    assert ema.values[0].tolist() == pytest.approx([0.25 * 9 / 11 + 2.25] * 2)

    every8 = WeightsEMA([param], decay=0.9, update_interval=8)
    param.fill_(5.0)
    assert [every8.update(s) for s in range(1, 7)] == [None] * 6
    assert every8.values[0].tolist() == [3.0, 3.0]
    assert every8.update(7) == pytest.approx(8 / 17)  # (s + 1) % 8 == 0
    assert every8.values[0].tolist() == pytest.approx([8 / 17 * 3 + 9 / 17 * 5] * 2)


def test_ema_without_warmup_takes_its_decay_from_the_first_update():
    """verl-omni's DMD2 student EMA: values <- 0.999 values + 0.001 params from step 1 on."""
    param = torch.zeros(2)
    ema = WeightsEMA([param], decay=0.999, warmup=False)
    param.fill_(1.0)
    assert ema.update(1) == pytest.approx(0.999)
    assert ema.values[0].tolist() == pytest.approx([0.001, 0.001])
    param.fill_(2.0)
    ema.update(2)
    assert ema.values[0].tolist() == pytest.approx([0.999 * 0.001 + 0.001 * 2] * 2)


def test_engine_keeps_the_ema_and_swaps_it_in_and_back(make_engine, tiny_pixel_path):
    engine, _ = make_engine(tiny_pixel_path, actor__ema_decay=0.9)
    params = engine.model.trainable_parameters()
    before = [p.detach().clone() for p in params]
    batch = engine.rollout(["a red circle"] * 4, [0, 1, 2, 3])
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    metrics = engine.update(batch)
    assert metrics["weights_ema_decay"] == pytest.approx(2 / 11)
    after = [p.detach().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    for value, old, new in zip(engine.weights_ema.values, before, after):
        assert torch.allclose(value, 2 / 11 * old + 9 / 11 * new, atol=1e-7)
    seeds = [5, 6]
    with torch.no_grad():
        current = engine.rollout(["a red circle"] * 2, seeds, policy="current")["images"]
        averaged = engine.rollout(["a red circle"] * 2, seeds, policy="ema")["images"]
    assert all(torch.equal(p, a) for p, a in zip(params, after))  # the swap gave the weights back
    assert not torch.equal(current, averaged)


def test_checkpoint_validation_and_export_use_the_ema(tmp_path, tiny_pixel_path):
    """A run keeping an EMA validates it: its validation images are what the checkpoint's engine
    samples with the EMA, not with the trained weights. The checkpoint restores it, evaluation
    (`load_for_eval`) and `pixelrl export` take it, and `--weights actor` the trained weights."""
    from pixelrl.cli import main
    from pixelrl.config.sections import from_yaml_text
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.evaluate import generate
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.engine.policy_engine import PolicyEngine
    from pixelrl.models.loader import load_configured_model, load_folder_model
    from pixelrl.sampling.rollout import SamplingSettings
    from pixelrl.sampling.windows import Window

    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "a red circle", "data_source": "shapes"}))
    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "actor.ema_decay=0.5", "trainer.total_training_steps=3",
                          f"data.val_files=[{val}]", "val_kwargs.n=2", "val_kwargs.num_steps=4", "trainer.test_freq=3")
    assert code == 0
    ckpt = run / "checkpoints" / "global_step_3"
    assert (ckpt / "actor" / "ema.safetensors").is_file() and (ckpt / "actor" / "ema_adapter").is_dir()
    cfg = from_yaml_text((ckpt / "config.yaml").read_text())
    engine = PolicyEngine(load_configured_model(cfg.model), cfg)
    load_engine(engine, ckpt / "actor")
    dump = run / "validation" / "step_000003"
    rows = [json.loads(line) for line in (dump / "samples.jsonl").read_text().splitlines()]
    logged = np.stack([np.array(Image.open(dump / f"{r['index']:05d}.png")) for r in rows]).astype(int)
    settings = SamplingSettings(noise_level=0.0, guidance_scale=cfg.rollout.guidance_scale)
    sampled = {policy: engine.rollout([r["prompt"] for r in rows], [r["seed"] for r in rows], window=Window(0, 0),
                                      settings=settings, num_steps=4, policy=policy)["images"].numpy().astype(int)
               for policy in ("ema", "current")}
    assert np.abs(logged - sampled["ema"]).max() <= 1
    assert np.abs(logged - sampled["current"]).max() > 1

    kwargs = dict(num_steps=4, guidance_scale=cfg.rollout.guidance_scale, resolution=32)
    evaluated = generate(load_for_eval(checkpoint=str(ckpt)), ["a red circle"], [7], **kwargs).numpy().astype(int)
    assert main(["export", str(ckpt), str(tmp_path / "ema_pipe")]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "actor_pipe"), "--weights", "actor"]) == 0
    exported = {name: generate(load_folder_model(tmp_path / name), ["a red circle"], [7], **kwargs).numpy().astype(int)
                for name in ("ema_pipe", "actor_pipe")}
    assert np.abs(exported["ema_pipe"] - evaluated).max() <= 1
    assert np.abs(exported["actor_pipe"] - evaluated).max() > 1


def test_resuming_without_the_ema_the_config_asks_for_names_the_fix(tmp_path, tiny_pixel_path):
    from pixelrl.engine.checkpoint import CheckpointError

    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "trainer.total_training_steps=1")
    assert code == 0
    with pytest.raises(CheckpointError, match="actor.ema_decay=0"):
        from pixelrl.config.sections import from_yaml_text
        from pixelrl.engine.checkpoint import load_engine
        from pixelrl.engine.policy_engine import PolicyEngine
        from pixelrl.models.loader import load_configured_model

        ckpt = run / "checkpoints" / "global_step_1"
        cfg = from_yaml_text((ckpt / "config.yaml").read_text())
        cfg.actor.ema_decay = 0.9
        load_engine(PolicyEngine(load_configured_model(cfg.model), cfg), ckpt / "actor")
