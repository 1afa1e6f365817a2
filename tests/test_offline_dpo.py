"""Offline Diffusion-DPO: the preference-file reader and its errors, pairing for
`make-preferences`, the model's image encoder, and a run through `pixelrl train` that learns
from a dataset the test writes."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_learned, damaged_png, read_metrics, train_cli
from pixelrl.data.preferences import DatasetError, PreferenceDataset, read_preference_file
from pixelrl.shapes.preferences import preference_pairs


def _png(path, array):
    Image.fromarray(array).save(path)
    return path.name


def _flat(seed, size=32):
    colour = np.random.default_rng(seed).integers(0, 256, 3, dtype=np.uint8)
    return np.broadcast_to(colour, (size, size, 3)).copy()


def _noise(seed, size=32):
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _write_pairs(folder, prompts, pairs_per_prompt=2):
    """chosen: a flat colour (JPEG-compressible); rejected: uniform noise."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for p, prompt in enumerate(prompts):
        for k in range(pairs_per_prompt):
            seed = 100 * p + k
            lines.append({"prompt": prompt, "chosen": _png(folder / f"c{seed}.png", _flat(seed)),
                          "rejected": _png(folder / f"r{seed}.png", _noise(seed)),
                          "chosen_score": 1.0, "rejected_score": 0.0})
    path = folder / "preferences.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_reader_accepts_paths_base64_and_parquet_bytes_and_decodes_pixels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chosen, rejected = _flat(1), _noise(2)
    buffer = io.BytesIO()
    Image.fromarray(rejected).save(buffer, format="PNG")
    _png(tmp_path / "c.png", chosen)
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "c.png",
                                                  "rejected": {"bytes": base64.b64encode(buffer.getvalue()).decode()}}))
    pq.write_table(pa.table({"prompt": ["b"], "chosen": [str(tmp_path / "c.png")], "rejected": [buffer.getvalue()],
                             "chosen_score": [0.9]}), tmp_path / "d.parquet")
    data = PreferenceDataset.from_files([tmp_path / "d.jsonl", tmp_path / "d.parquet"], resolution=32)
    assert [data[i]["prompt"] for i in range(2)] == ["a", "b"]
    for i in range(2):
        assert np.array_equal(data[i]["chosen"], chosen) and np.array_equal(data[i]["rejected"], rejected)
    assert data.rows[1]["chosen_score"] == 0.9 and "chosen_score" not in data.rows[0]


@pytest.mark.parametrize("case, message", [
    ("missing", "row 2: `rejected` image"),
    ("unreadable", "row 2: `chosen` image"),
    ("damaged", "row 2: `rejected` image"),
    ("sizes", "row 2: chosen is 32x32 but rejected is 16x16"),
    ("resolution", "row 2: images are 16x16, the model trains at rollout.resolution = 32"),
    ("no_key", "row 2: `chosen` must be an image path or image bytes"),
    ("score", "row 2: `rejected_score` must be a number"),
])
def test_bad_rows_name_the_file_and_the_row(tmp_path, case, message):
    good = {"prompt": "a", "chosen": _png(tmp_path / "c.png", _flat(0)), "rejected": _png(tmp_path / "r.png", _noise(0))}
    _png(tmp_path / "small.png", _flat(0, size=16))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    bad = dict(good)
    if case == "missing":
        bad["rejected"] = "gone.png"
    elif case == "unreadable":
        bad["chosen"] = "broken.png"
    elif case == "damaged":  # whole chunks, damaged pixel data: found when the file is read
        bad["rejected"] = damaged_png(tmp_path / "damaged.png")
    elif case == "sizes":
        bad["rejected"] = "small.png"
    elif case == "resolution":
        bad["chosen"] = bad["rejected"] = "small.png"
    elif case == "no_key":
        del bad["chosen"]
    else:
        bad["rejected_score"] = "high"
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DatasetError) as err:
        read_preference_file(path, resolution=32)
    assert str(path) in str(err.value) and message in str(err.value)


def test_preference_pairs_best_with_worst_under_a_margin():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # stable order: best 0, 2, 5; worst (from the end) 4, 3, 1
    assert preference_pairs(scores, margin=1.0, max_pairs=2) == [(0, 4), (2, 3)]
    assert preference_pairs(scores, margin=1.0, max_pairs=5) == [(0, 4), (2, 3), (5, 1)]
    assert preference_pairs(torch.tensor([0.7, 0.5, 0.6]), margin=0.15, max_pairs=3) == [(0, 1)]
    assert preference_pairs(torch.ones(4), margin=0.5, max_pairs=2) == []


def test_encode_inverts_decode(tiny_sd3_path, tiny_pixel_path):
    from pixelrl.models import load_model

    images = torch.from_numpy(np.stack([_flat(3), _noise(4)]))
    pixel = load_model("sd3", tiny_pixel_path, max_sequence_length=0)
    assert torch.equal(pixel.decode(pixel.encode(images)), images)  # pixel space: exact
    latent = load_model("sd3", tiny_sd3_path, max_sequence_length=0)
    x0 = latent.encode(images)
    assert x0.shape == (2, *latent.latent_shape(32, 32)) and x0.dtype == torch.float32
    assert torch.equal(latent.encode(images), x0)  # the posterior mean: the same image, the same x0


@pytest.mark.learning
def test_offline_dpo_through_pixelrl_train_learns_from_a_written_dataset(tmp_path, tiny_pixel_path):
    """Chosen images are flat colours, rejected ones noise: after training on the pairs, the
    policy's own samples compress better (JPEG reward) than the base model's."""
    from pixelrl.config import load_config
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine import PolicyEngine
    from pixelrl.engine.evaluate import fixed_seed_reward as mean_reward
    from pixelrl.rewards import WeightedReward

    prompts = ["a red circle", "two blue squares", "a cat", "a house"]
    path = _write_pairs(tmp_path / "data", prompts)
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "trainer.experiment_name=flow_grpo_tiny", "algorithm.sample_source=offline",
                          f"data.train_files=[{path}]", "data.train_batch_size=4", "trainer.total_training_steps=12",
                          "actor.lr=0.03", config="dpo_tiny")
    assert code == 0
    metrics = read_metrics(run)
    assert len(metrics) == 12 and all(m["training/pairs"] == 4 for m in metrics)
    assert metrics[0]["data/chosen_score/mean"] == 1.0
    # the loss drives the implicit accuracy up on the training pairs
    assert np.mean([m["actor/implicit_acc"] for m in metrics[-4:]]) > np.mean([m["actor/implicit_acc"] for m in metrics[:2]])

    cfg = load_config(str(run / "config.yaml"), [])
    engine, reward = PolicyEngine.from_config(cfg), WeightedReward.from_functions(cfg.reward.functions)
    eval_prompts, eval_seeds = prompts * 4, list(range(10_000, 10_016))
    before = mean_reward(engine, reward, eval_prompts, eval_seeds)
    load_engine(engine, str(run / "checkpoints" / "global_step_12" / "actor"))
    after = mean_reward(engine, reward, eval_prompts, eval_seeds)
    # +0.047..+0.078 over kernel sets and seeds at lr 3e-2; at 1e-1 it swung from -0.059 to +0.084
    assert_learned(before, after, 0.025)


def test_an_offline_step_splits_its_pairs_not_prompts_times_rollout_n_into_mini_batches():
    """16 pairs a step in mini-batches of 8: 2 optimizer steps per epoch, whatever rollout.n says
    (shapes_dpo_offline keeps shapes_dpo's n = 8; counting 16 x 8 rows made 16 mini-batches of one
    pair each, and the learning-rate schedule 8 times too long)."""
    from pixelrl.config import load_config
    from pixelrl.engine.config import images_per_step, mini_batches_per_epoch, optimizer_steps_per_rollout

    cfg = load_config("shapes_dpo_offline", ["data.train_files=[no_such/preferences.jsonl]",
                                             "actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2"])
    assert cfg.rollout.n == 8 and cfg.data.train_batch_size == 16
    assert images_per_step(cfg) == 16 and mini_batches_per_epoch(cfg) == 2 and optimizer_steps_per_rollout(cfg) == 4


def test_offline_needs_dpo_and_a_file(tmp_path, tiny_pixel_path, capsys):
    code, _ = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "algorithm.sample_source=offline",
                        config="nft_tiny")
    assert code == 2 and "algorithm.sample_source" in capsys.readouterr().err
    code, _ = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "algorithm.sample_source=offline",
                        config="dpo_tiny")
    assert code == 2 and "data.train_files" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "nowhere.png", "rejected": "x.png"}))
    code, _ = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "algorithm.sample_source=offline",
                        f"data.train_files=[{tmp_path / 'p.jsonl'}]", config="dpo_tiny")
    assert code == 2 and "row 1: `chosen` image" in capsys.readouterr().err


def _write_edit_pairs(folder, source_colours):
    """(instruction, source, chosen, rejected) rows: 40 px flat sources (decoded at the run's
    condition size), one flat 32 px chosen edit and one noise rejected edit for all."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, colour in enumerate(source_colours):
        Image.new("RGB", (40, 40), colour).save(folder / f"source_{i}.png")
        rows.append({"prompt": "make it blue", "image": f"source_{i}.png",
                     "chosen": _png(folder / "chosen.png", _flat(0)), "rejected": _png(folder / "rejected.png", _noise(0))})
    file = folder / "edit_pairs.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return file


def test_edit_pairs_carry_their_sources_decoded_at_the_condition_size(tmp_path):
    file = _write_edit_pairs(tmp_path, [(200, 10, 10), (10, 200, 10)])
    data = PreferenceDataset.from_files([file], resolution=32, condition_size=(24, 24))
    first = data[0]
    assert first["chosen"].shape == (32, 32, 3) and len(first["condition_images"]) == 1
    assert first["condition_images"][0].shape == (24, 24, 3)
    assert tuple(first["condition_images"][0][12, 12]) == (200, 10, 10)
    batch = PreferenceDataset.collate([data[0], data[1]])
    assert len(batch["condition_images"]) == 2 and batch["chosen"].shape == (2, 32, 32, 3)


def test_offline_edit_pairs_train_under_their_own_sources(tmp_path, tiny_kontext_path, tiny_pixel_path, capsys):
    """Offline Diffusion-DPO on the tiny FLUX.1 Kontext model: two runs whose pairs differ only in
    their sources take different first gradients (same pairs, same draws), so the sources reach
    the denoiser (they were read past); sources for a text-to-image family are refused by name."""
    common = ("algorithm.trainer_type=forward_process", "diffusion_loss.name=diffusion_dpo",
              "algorithm.sample_source=offline", "algorithm.drop_zero_advantage=false", "trainer.backend=local",
              "trainer.logger=[jsonl]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
              "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.experiment_name=edit_dpo")
    losses = []
    for name, colours in (("red", [(200, 10, 10)] * 2), ("green", [(10, 200, 10)] * 2)):
        file = _write_edit_pairs(tmp_path / name / "data", colours)
        code, _ = train_cli(tmp_path / name, tiny_kontext_path, *common, "model.type=flux_kontext",
                            "model.max_sequence_length=16", f"data.train_files=[{file}]", config="flow_grpo_flux_tiny")
        assert code == 0
        # the first loss is log 2 whatever the sources (the policy is its reference); its gradient is not
        losses.append(read_metrics(tmp_path / name / "pixelrl" / "edit_dpo")[0]["actor/grad_norm"])
    assert losses[0] != losses[1]
    code, _ = train_cli(tmp_path / "t2i", tiny_pixel_path, *common, f"data.train_files=[{file}]")
    assert code != 0
    err = capsys.readouterr().err
    assert "data.train_files" in err and "takes 0 condition image(s) per prompt" in err


def test_make_preferences_shows_its_sampling_progress_and_writes_pairs(tmp_path, capsys):
    """`pixelrl make-preferences` samples for minutes on a real prompt set: it prints a progress
    line per batch of images (count, elapsed, ETA) on stderr, then the pairs it wrote."""
    import json

    from pixelrl.cli import main

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "a red circle", "metadata": {"category": "single_object", "relation": None,
                                                    "objects": [{"shape": "circle", "colour": "red", "count": 1}]}}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["make-preferences", str(tmp_path / "prefs"), "--prompts", str(prompts), "--n", "4", "--steps", "2",
                 "--margin", "0"]) == 0
    captured = capsys.readouterr()
    assert "generated images: 4/4" in captured.err and "eta" in captured.err
    assert (tmp_path / "prefs" / "preferences.jsonl").is_file() and "pairs from" in captured.out
