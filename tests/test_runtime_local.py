"""Trainer behaviour without Ray (the same worker code in-process): exact resume, crash-safe
checkpoints, validation, dumps, export, tracking."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, train_cli

LOCAL = ("trainer.backend=local", "trainer.logger=[jsonl]")


def _weights(run, step):
    return load_file(str(run / "checkpoints" / f"global_step_{step}" / "actor" / "trainable.safetensors"))


def _rewards(run):
    return [m["critic/rewards/mean"] for m in read_metrics(run)]


def test_resume_reproduces_an_uninterrupted_run_bitwise_and_survives_a_crashed_write(tmp_path, tiny_pixel_path,
                                                                                     monkeypatch):
    from pixelrl.trainers import checkpointing

    steps4 = ("trainer.total_training_steps=4", "trainer.save_freq=2", "data.train_batch_size=2",
              "actor.ppo_mini_batch_size=4")
    code, straight = train_cli(tmp_path / "straight", tiny_pixel_path, *LOCAL, *steps4)
    assert code == 0

    # 2 steps, stop; then resume for 2 more
    code, split = train_cli(tmp_path / "split", tiny_pixel_path, *LOCAL, *steps4[1:], "trainer.total_training_steps=2")
    assert code == 0
    code, _ = train_cli(tmp_path / "split", tiny_pixel_path, *LOCAL, *steps4)
    assert code == 0
    assert _rewards(split) == _rewards(straight)
    a, b = _weights(straight, 4), _weights(split, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # a crash while writing the step-4 checkpoint leaves step 2 as the latest, and auto resumes from it
    def crash(tmp_folder):
        if tmp_folder.name.startswith("global_step_4"):
            raise KeyboardInterrupt("simulated kill during the checkpoint write")

    monkeypatch.setattr(checkpointing, "_before_commit", crash)
    code, crashed = train_cli(tmp_path / "crashed", tiny_pixel_path, *LOCAL, *steps4)
    assert code == 130
    root = crashed / "checkpoints"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (root / "global_step_4.tmp").is_dir() and not (root / "global_step_4").exists()
    monkeypatch.setattr(checkpointing, "_before_commit", lambda tmp_folder: None)
    code, _ = train_cli(tmp_path / "crashed", tiny_pixel_path, *LOCAL, *steps4)
    assert code == 0
    c = _weights(crashed, 4)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_validation_metrics_dumps_grids_and_rotation(tmp_path, tiny_pixel_path):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"prompt": p, "data_source": src})
                             for p, src in [("a red circle", "shapes"), ("a cat", "animals"), ("a dog", "animals")]))
    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "trainer.logger=[jsonl,tensorboard]",
                          f"data.val_files=[{val}]", "val_kwargs.n=2", "val_kwargs.num_steps=4",
                          "trainer.val_before_train=true", "trainer.test_freq=2", "trainer.total_training_steps=4",
                          "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
                          f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", "trainer.log_image_grid_every=2",
                          "val_kwargs.rewards=[{name: jpeg_incompressibility}]")
    assert code == 0
    metrics = read_metrics(run)
    _check_gold_and_diversity(run, metrics[-1])
    assert "val-core/animals/reward/mean@2" in metrics[0] and "val-core/shapes/reward/best@2" in metrics[0]
    assert "val-core/animals/reward/mean@2" in metrics[2] and "val-core/animals/reward/mean@2" not in metrics[1]
    dump = run / "validation" / "step_000004"
    lines = (dump / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 6 and (dump / "00005.png").is_file()
    assert len((tmp_path / "rollouts" / "step_000001" / "samples.jsonl").read_text().splitlines()) == 16
    assert (run / "samples" / "val_samples_step000004.png").is_file()
    assert (run / "samples" / "train_samples_step000002.png").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_export_pipeline_and_adapter_load_in_diffusers(tmp_path, tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    from pixelrl.cli import main

    code, run = train_cli(tmp_path, tiny_sd3_path, *LOCAL, "trainer.total_training_steps=2")
    assert code == 0
    ckpt = run / "checkpoints" / "global_step_2"
    assert main(["export", str(ckpt), str(tmp_path / "pipeline")]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    exported = StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipeline", text_encoder_3=None, tokenizer_3=None)
    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path, text_encoder_3=None, tokenizer_3=None)
    kwargs = dict(num_inference_steps=3, height=32, width=32, output_type="np", max_sequence_length=0,
                  guidance_scale=1.0)
    fused = exported("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    plain = base("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    base.load_lora_weights(tmp_path / "adapter")
    adapted = base("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    assert fused.shape == (1, 32, 32, 3)
    assert abs(fused - plain).max() > 1e-4  # training changed the model
    assert abs(fused - adapted).max() < 1e-3  # fused pipeline == base + adapter


def test_exported_pipeline_declares_how_it_trained_and_samples_like_its_checkpoint(tmp_path, tiny_sd3_path, capsys):
    """The run trained with zero T5 tokens; its exported folder says so, so that pixelrl loads it
    as it trained (the family default, 256 zero tokens, would give other images) and samples what
    the checkpoint does; the plain diffusers lines the export prints pass those zero tokens too
    and, run as printed, sample the same picture."""
    import numpy as np

    from pixelrl.cli import main
    from pixelrl.engine.evaluate import generate
    from pixelrl.trainers.checkpointing import load_for_eval
    from pixelrl.models.loader import declared_options

    code, run = train_cli(tmp_path, tiny_sd3_path, *LOCAL, "trainer.total_training_steps=1")
    assert code == 0
    ckpt = run / "checkpoints" / "global_step_1"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "pipeline")]) == 0
    printed = capsys.readouterr().out.split("in plain diffusers:\n", 1)[1]
    assert "max_sequence_length=0" in printed
    assert declared_options(tmp_path / "pipeline") == {"max_sequence_length": 0}
    exported = load_for_eval(str(tmp_path / "pipeline"))
    assert exported.max_sequence_length == 0
    kwargs = dict(num_steps=3, guidance_scale=1.0, resolution=32)
    from_export = generate(exported, ["a red circle"], [0], **kwargs)
    from_checkpoint = generate(load_for_eval(checkpoint=str(ckpt)), ["a red circle"], [0], **kwargs)
    assert (from_export.float() - from_checkpoint.float()).abs().max() <= 1
    sampler = json.loads((tmp_path / "pipeline" / "pixelrl_sampler.json").read_text())  # as the run validated
    sampled = generate(exported, ["a red circle"], [0], num_steps=sampler["num_steps"],
                       guidance_scale=sampler["guidance_scale"], resolution=32)
    namespace: dict = {}
    exec("\n".join(line[4:] for line in printed.splitlines()), namespace)  # the user's copy-paste
    theirs = np.asarray(namespace["sample"], dtype=np.int16)
    assert np.abs(theirs - sampled[0].numpy().astype(np.int16)).max() <= 3
    from pixelrl.models.loader import load_folder_model

    as_family_default = generate(load_folder_model(tmp_path / "pipeline", max_sequence_length=256), ["a red circle"],
                                 [0], **kwargs)
    assert (as_family_default.float() - from_checkpoint.float()).abs().max() > 8


def test_time_budget_stops_after_the_step_that_uses_it_with_a_checkpoint(tmp_path, tiny_pixel_path):
    """A tiny budget is used up by the first step: the run stops there, saved and validated as at
    its last step, and a resume with the budget lifted continues from it."""
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "a red circle", "data_source": "shapes"}))
    budget = ("trainer.time_budget_s=0.001", "trainer.total_training_steps=3", f"data.val_files=[{val}]",
              "val_kwargs.num_steps=2")
    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, *budget)
    assert code == 0
    metrics = read_metrics(run)
    assert len(metrics) == 1 and "val-core/shapes/reward/mean@1" in metrics[0]
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_1"]
    code, _ = train_cli(tmp_path, tiny_pixel_path, *LOCAL, *budget[1:])
    assert code == 0
    assert [m["training/global_step"] for m in read_metrics(run)] == [1, 2, 3]


def _check_gold_and_diversity(run, last):
    """The gold reward and the diversity logged at the last validation equal what the production
    reward and diversity functions give on the validation images written to disk."""
    import numpy as np
    from PIL import Image

    from pixelrl.engine.evaluate import diversity
    from pixelrl.rewards.registry import get_reward

    dump = run / "validation" / "step_000004"
    rows = [json.loads(line) for line in (dump / "samples.jsonl").read_text().splitlines()]
    images = torch.from_numpy(np.stack([np.array(Image.open(dump / f"{r['index']:05d}.png")) for r in rows]))
    gold = get_reward("jpeg_incompressibility")(images, [r["prompt"] for r in rows], [{}] * len(rows))
    animals = [i for i, r in enumerate(rows) if r["prompt"] in ("a cat", "a dog")]
    logged = last["val-core/animals/gold/jpeg_incompressibility/mean@2"]
    assert logged == pytest.approx(float(next(iter(gold.values()))[animals].mean()), abs=1e-6)
    assert logged != pytest.approx(last["val-core/animals/reward/mean@2"], abs=1e-3)  # not the training reward
    expected = diversity(images[animals], [rows[i] for i in animals])["pairwise_l1"]
    assert last["val-core/animals/diversity@2"] == pytest.approx(expected, abs=1e-6) and expected > 0


def test_cosine_lr_decays_over_a_diffusion_runs_optimizer_steps(tmp_path, tiny_pixel_path):
    """4 prompts x 4 images in mini-batches of 8: 2 optimizer steps per training step, 6 over 3
    steps; the logged lr after each step follows half a cosine from 1e-2 to the floor 1e-3 at the
    last optimizer step (k = 2, 4, 6 of 6), and a cosine shorter than the warm-up is refused."""
    import math

    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, "trainer.total_training_steps=3",
                          "actor.lr_schedule=cosine", "actor.min_lr_ratio=0.1", "actor.ppo_mini_batch_size=8")
    assert code == 0
    lrs = [row["actor/lr"] for row in read_metrics(run)]
    assert lrs == pytest.approx([1e-3 + 9e-3 * (1 + math.cos(math.pi * k / 6)) / 2 for k in (2, 4, 6)])
    code, _ = train_cli(tmp_path / "short", tiny_pixel_path, *LOCAL, "trainer.total_training_steps=3",
                        "actor.lr_schedule=cosine", "actor.warmup_steps=3")
    assert code == 2  # 3 optimizer steps do not outlast 3 warm-up steps


def test_validation_logs_the_mean_over_sources_and_keeps_the_best_checkpoint(tmp_path, tiny_pixel_path):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"prompt": p, "data_source": src})
                             for p, src in [("a red circle", "shapes"), ("a cat", "animals"), ("a dog", "animals")]))
    key = "val-core/overall/reward/mean@2"
    code, run = train_cli(tmp_path, tiny_pixel_path, *LOCAL, f"data.val_files=[{val}]", "val_kwargs.n=2",
                          "val_kwargs.num_steps=4", "trainer.val_before_train=true", "trainer.test_freq=1",
                          "trainer.total_training_steps=4", "trainer.save_freq=0", "trainer.max_ckpt_to_keep=1",
                          f"trainer.best_metric={key}")
    assert code == 0
    metrics = read_metrics(run)
    for row in metrics:  # GenEval's overall: the mean of the per-source means
        assert row[key] == pytest.approx((row["val-core/shapes/reward/mean@2"] + row["val-core/animals/reward/mean@2"]) / 2)
        assert row["val-core/overall/diversity@2"] == pytest.approx(
            (row["val-core/shapes/diversity@2"] + row["val-core/animals/diversity@2"]) / 2)
    trained = {int(row["training/global_step"]): row[key] for row in metrics if row.get("training/global_step")}
    best_step = max(trained, key=trained.get)  # the first of equal values, as the trainer keeps it
    pointer = json.loads((run / "checkpoints" / "best_checkpoint.json").read_text())
    assert (pointer["step"], pointer["value"]) == (best_step, trained[best_step])
    assert {f"global_step_{best_step}", "global_step_4"} == {p.name for p in (run / "checkpoints").glob("global_step_*")}
