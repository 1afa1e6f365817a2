"""Image conditions (editing): a sample's condition is its text and its condition images, from the
model family that takes them (FLUX.1 Kontext here) to every forward that re-reads the sample."""

import pytest
import torch

from conftest import check_edits_match_pipeline, damaged_png, random_sources, tiny_config
from pixelrl.core.batch import Batch
from pixelrl.core.errors import ConfigError
from pixelrl.engine import PolicyEngine
from pixelrl.models import model_family

PROMPTS = ["make the red circle blue", "add a square"]


def _kontext_config(path, **overrides):
    return tiny_config(path, model__type="flux_kontext", model__max_sequence_length=16,
                       rollout__guidance_scale=3.5, **overrides)


def test_kontext_ode_sample_and_saved_lora_equal_flux_kontext_pipeline(tiny_kontext_path, tmp_path):
    """pixelrl's ODE edit of a source image from a seed is `FluxKontextPipeline`'s (the condition
    latents appended with their own position ids, the prediction cropped to the target), before
    and after a LoRA the checkpoint writes and the pipeline loads."""
    from PIL import Image

    from pixelrl.sampling import SamplingSettings, Window, rollout

    cfg = _kontext_config(tiny_kontext_path, rollout__num_steps=4)
    engine = PolicyEngine.from_config(cfg)
    pipe = model_family("flux_kontext").load_pipeline(engine.model.path)
    sources = random_sources(0)

    def pipeline_latents():
        out = []
        for prompt, (source,), seed in zip(PROMPTS, sources, (3, 4)):
            packed = pipe(prompt=prompt, image=Image.fromarray(source.numpy()), height=32, width=32, num_inference_steps=4,
                          guidance_scale=3.5, max_sequence_length=16, output_type="latent", _auto_resize=False, max_area=32 * 32,
                          generator=torch.Generator().manual_seed(seed)).images
            out.append(pipe._unpack_latents(packed, 32, 32, pipe.vae_scale_factor))
        return torch.cat(out)

    def our_latents(images=sources):
        settings = SamplingSettings(noise_level=0.0, guidance_scale=3.5)
        with torch.no_grad():
            return rollout(engine.model, PROMPTS, [3, 4], sigmas=engine.sigmas, window=Window(0, 0),
                           settings=settings, height=32, width=32, condition_images=images).final_latents

    check_edits_match_pipeline(engine, pipe, pipeline_latents, our_latents, sources, tmp_path)


def test_a_wide_edit_equals_flux_kontext_pipeline_and_generate_follows_the_source(tiny_kontext_path, tmp_path,
                                                                                    capsys):
    """An edit whose output is not square (24 x 40 px, as a 5:3 source gives at 32 px) is
    `FluxKontextPipeline`'s at that size; `pixelrl generate` makes its output so from a 50 x 30
    source and says so."""
    from PIL import Image

    from pixelrl.cli import main
    from pixelrl.sampling import SamplingSettings, Window, rollout

    engine = PolicyEngine.from_config(_kontext_config(tiny_kontext_path, rollout__num_steps=3))
    model = engine.model
    assert model.edit_output_size(32, 50, 30) == (24, 40)  # sqrt(1024 * 5/3) = 41.3 -> 40; 24.8 -> 24 (unit 4)
    pipe = model_family("flux_kontext").load_pipeline(model.path)
    source = torch.randint(0, 256, (24, 40, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = pipe(prompt=PROMPTS[0], image=Image.fromarray(source.numpy()), height=24, width=40, num_inference_steps=3,
                  guidance_scale=3.5, max_sequence_length=16, output_type="latent", _auto_resize=False,
                  max_area=24 * 40, generator=torch.Generator().manual_seed(5)).images
    expected = pipe._unpack_latents(packed, 24, 40, pipe.vae_scale_factor)
    sigmas = model.sigmas(3, 24, 40)
    with torch.no_grad():
        ours = rollout(model, PROMPTS[:1], [5], sigmas=sigmas, window=Window(0, 0), height=24, width=40,
                       settings=SamplingSettings(noise_level=0.0, guidance_scale=3.5),
                       condition_images=[(source,)]).final_latents
    assert ours.shape == expected.shape == (1, 4, 12, 20) and torch.allclose(ours, expected, atol=1e-5)

    Image.new("RGB", (50, 30), (220, 30, 30)).save(tmp_path / "wide.png")
    assert main(["generate", "--model", str(tiny_kontext_path), "--prompt", "make it blue", "--steps", "2", "--n", "1",
                 "--resolution", "32", "--image", str(tmp_path / "wide.png"), "--out", str(tmp_path / "a.png")]) == 0
    assert "40 x 24 px (width x height)" in capsys.readouterr().out
    assert Image.open(tmp_path / "a.png").size == (40 * 4, 24 * 4)  # the grid draws each image 4x


def test_a_source_is_cropped_or_letterboxed_to_the_output_by_hand(tmp_path):
    """A 40 x 20 source (left half red, right half blue) at a 32 x 32 output: `crop` keeps its
    centred 20 x 20 (red left of column 16, blue right of it, no white); `pad` keeps all of it,
    scaled to 32 x 16 and centred on white (rows 8 to 23); `stretch` fills the square with it."""
    from PIL import Image

    from pixelrl.data.prompts import load_condition_image

    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))
    image.save(tmp_path / "wide.png")
    cropped = load_condition_image(str(tmp_path / "wide.png"), 32, 32, "crop")
    assert tuple(cropped[16, 2].tolist()) == (255, 0, 0) and tuple(cropped[16, 29].tolist()) == (0, 0, 255)
    assert tuple(cropped[0, 2].tolist()) == (255, 0, 0)  # no white band
    padded = load_condition_image(str(tmp_path / "wide.png"), 32, 32, "pad")
    assert padded.shape == (32, 32, 3)
    assert all(tuple(padded[row, 16].tolist()) == (255, 255, 255) for row in (0, 7, 24, 31))
    assert tuple(padded[12, 2].tolist()) == (255, 0, 0) and tuple(padded[12, 29].tolist()) == (0, 0, 255)
    assert tuple(padded[8, 4].tolist()) != (255, 255, 255) and tuple(padded[23, 4].tolist()) != (255, 255, 255)
    stretched = load_condition_image(str(tmp_path / "wide.png"), 32, 32, "stretch")  # all of it, squeezed
    assert tuple(stretched[0, 2].tolist()) == (255, 0, 0) and tuple(stretched[31, 29].tolist()) == (0, 0, 255)


def test_data_condition_fit_reaches_the_rows_and_is_refused_without_sources(tiny_flux_path, tmp_path):
    """`data.condition_fit=pad` decodes a run's rows letterboxed; on a text-to-image family it is one
    error naming the field."""
    from PIL import Image

    from pixelrl.trainers.datasets import check_conditions, datasets_of

    file = _write_edit_rows(tmp_path, EDIT_ROWS[:2])
    Image.new("RGB", (40, 20), (0, 0, 0)).save(tmp_path / "source_0.png")
    cfg = _kontext_config(tiny_flux_path, data__train_files=[str(file)], data__condition_fit="pad",
                          data__train_batch_size=2)
    train, _ = datasets_of(cfg)
    (letterboxed,) = train[0]["condition_images"]
    assert tuple(letterboxed[0, 0].tolist()) == (255, 255, 255) and tuple(letterboxed[16, 16].tolist()) == (0, 0, 0)
    cfg.model.type = "flux"
    with pytest.raises(ConfigError, match=r"data.condition_fit.*takes none: leave it at crop"):
        check_conditions(cfg, train, "data.train_files")


def test_a_condition_survives_rollout_rescore_and_reference_bitwise(tiny_kontext_path):
    """The rollout keeps each row's condition images; re-scoring the stored transitions (old
    policy) and the reference see exactly the rollout's input: their log-probs are the rollout's
    bits. The same rows scored with each other's sources are not."""
    engine = PolicyEngine.from_config(_kontext_config(tiny_kontext_path))
    sources = random_sources(1)
    batch = engine.rollout(PROMPTS, [5, 6], condition_images=sources)
    assert batch["condition_images"] == sources
    assert batch["log_probs"].shape[1] > 0
    assert torch.equal(engine.score(batch, "current")["old_log_probs"], batch["log_probs"])
    assert torch.equal(engine.score(batch, "reference")["ref_log_probs"], batch["log_probs"])  # LoRA B = 0
    swapped = Batch(dict(batch.tensors), {**batch.values, "condition_images": list(reversed(sources))}, batch.info)
    assert not torch.equal(engine.score(swapped, "current")["old_log_probs"], batch["log_probs"])


def test_condition_latents_do_not_depend_on_the_rows_around_them(tiny_kontext_path):
    """Each source is encoded alone and cached by content: a row's condition latents are the same
    bits alone, in a batch, and after the cache is emptied."""
    model = model_family("flux_kontext")(tiny_kontext_path, max_sequence_length=16)
    sources = random_sources(2, 3)
    together = model.encode_conditions(PROMPTS + ["remove the circle"], sources).condition_latents
    model._image_cache.clear()
    alone = model.encode_conditions(PROMPTS[1:2], sources[1:2]).condition_latents
    assert together.shape == (3, 1, *model.latent_shape(32, 32))
    assert torch.equal(together[1], alone[0])


def test_a_family_refuses_a_number_of_condition_images_it_cannot_take(tiny_flux_path, tiny_kontext_path):
    flux = model_family("flux")(tiny_flux_path, max_sequence_length=16)
    with pytest.raises(ConfigError, match="takes 0 per sample"):
        flux.encode_conditions(PROMPTS, random_sources(3))
    kontext = model_family("flux_kontext")(tiny_kontext_path, max_sequence_length=16)
    two = [row + row for row in random_sources(3)]
    with pytest.raises(ConfigError, match="takes 1 per sample"):
        kontext.encode_conditions(PROMPTS, two)
    # text-to-image rows (no condition) stay as they were on a text-to-image family
    assert flux.encode_conditions(PROMPTS, [(), ()]).condition_latents is None


def _write_edit_rows(folder, rows):
    """A jsonl of edit rows and 40 px source PNGs (decoded at the run's 32 px), beside it."""
    import json

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        colour = (60 * i, 255 - 60 * i, 128)
        Image.new("RGB", (40, 40), colour).save(folder / f"source_{i}.png")
    file = folder / "edits.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return file


EDIT_ROWS = [{"prompt": "make it blue", "image": f"source_{i}.png"} for i in range(4)] + \
    [{"prompt": "make it blue", "images": ["source_0.png"]}]  # the same prompt, another source


def test_an_edit_run_trains_and_validates_on_its_sources_through_pixelrl_train(tiny_kontext_path, tmp_path):
    """Flow-GRPO on the tiny Kontext model from a file of (instruction, source) rows, rewarded for
    preserving the source: the rows' sources are decoded at the run's size, every rollout,
    update, reward and validation sees them, and the run ends with its checkpoint."""
    from conftest import read_metrics, train_cli

    file = _write_edit_rows(tmp_path / "data", EDIT_ROWS)
    code, _ = train_cli(tmp_path / "out", tiny_kontext_path, "model.type=flux_kontext", "model.max_sequence_length=16",
                        f"data.train_files=[{file}]", f"data.val_files=[{file}]", "data.train_batch_size=2",
                        "rollout.n=2", "actor.ppo_micro_batch_size=2", "trainer.backend=local",
                        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2",
                        "trainer.experiment_name=edit", "reward.functions=[{name: source_preservation}]",
                        config="flow_grpo_flux_tiny")
    assert code == 0
    run = tmp_path / "out" / "pixelrl" / "edit"
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "actor/pg_loss" in r][-1] == 2
    assert any(key.startswith("val-core/edits/reward") for r in rows for key in r)
    # the reward read each sample's source: an untrained edit of a flat source keeps some of it
    assert 0 < [r for r in rows if "critic/rewards/mean" in r][-1]["critic/rewards/mean"] < 1
    assert (run / "checkpoints" / "global_step_2").is_dir()
    # the validation's source distance is the preservation reward's complement, on the same edits
    val = [r for r in rows if "val-core/edits/reward/mean@1" in r][-1]
    assert val["val-aux/image/source_distance"] == pytest.approx(1 - val["val-core/edits/reward/mean@1"], abs=1e-6)
    assert val["val-aux/image/x0_rms"] > 0


def _write_aspect_rows(folder, sizes):
    """Edit rows whose sources have the given (width, height), one colour each."""
    import json

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (40 * i % 256, 200, 120)).save(folder / f"source_{i}.png")
    file = folder / "edits.jsonl"
    file.write_text("".join(json.dumps({"prompt": f"edit {i}", "image": f"source_{i}.png"}) + "\n"
                            for i in range(len(sizes))))
    return file


def test_rows_keep_their_aspect_and_a_lone_size_joins_the_nearest(tmp_path):
    """Under rollout.output_aspect=source, 48 x 32 sources decode at 40 x 28 (about 32 x 32 pixels,
    sides rounded to 4) and 32 x 48 ones at 28 x 40; the one square source, a size no batch of 2 can
    fill, joins the nearest (a tie: the first by size) and is cropped to it; the loader's buckets
    are the sizes."""
    from pixelrl.data.prompts import PromptDataset
    from pixelrl.models.base import area_size

    file = _write_aspect_rows(tmp_path, [(48, 32)] * 3 + [(32, 48)] * 3 + [(40, 40)])
    data = PromptDataset.from_files([file]).keeping_aspects(lambda w, h: area_size(32, w, h, 4), batch_size=2)
    wide, tall = ((28, 40),), ((40, 28),)
    assert data.row_sizes == [wide] * 3 + [tall] * 3 + [wide]
    assert data.condition_buckets() == data.row_sizes and data.bucket_counts() == {wide: 4, tall: 3}
    assert data[6]["condition_images"][0].shape == (28, 40, 3) and data[3]["condition_images"][0].shape == (40, 28, 3)
    weighted = data.weighted({"edits": 2})
    assert weighted.row_sizes == [sizes for sizes in data.row_sizes for _ in range(2)]


def test_an_edit_rollout_follows_its_sources_aspect(tiny_kontext_path):
    """rollout.output_aspect=source: a call of 40 x 28 sources samples 40 x 28 edits on the grid
    shifted for that size; a call mixing sizes is refused."""
    engine = PolicyEngine.from_config(_kontext_config(tiny_kontext_path, rollout__output_aspect="source"))
    wide = torch.zeros(28, 40, 3, dtype=torch.uint8)
    batch = engine.rollout(PROMPTS, [1, 2], condition_images=[(wide,), (wide,)])
    assert batch["images"].shape == (2, 28, 40, 3)
    assert torch.equal(batch["sigmas"][0], engine.schedule(engine.cfg.rollout.num_steps, (28, 40))[:-2])
    with pytest.raises(ValueError, match="one size"):
        engine.rollout(PROMPTS, [1, 2], condition_images=[(wide,), (torch.zeros(32, 32, 3, dtype=torch.uint8),)])


def test_an_edit_run_in_its_sources_aspects_trains_and_validates_each_size(tiny_kontext_path, tmp_path, capsys):
    """pixelrl train with rollout.output_aspect=source on rows of two aspects: every step samples
    one size, validation generates each size apart, scores them, and dumps each edit at its own
    size; a lone size with nothing of its number of pictures to join is refused by name."""
    from PIL import Image

    from conftest import read_metrics, train_cli

    file = _write_aspect_rows(tmp_path / "data", [(48, 32)] * 2 + [(32, 48)] * 2)
    common = ("model.type=flux_kontext", "model.max_sequence_length=16", f"data.train_files=[{file}]",
              f"data.val_files=[{file}]", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_micro_batch_size=2",
              "trainer.backend=local", "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=-1",
              "reward.functions=[{name: source_preservation}]", "rollout.output_aspect=source")
    code, _ = train_cli(tmp_path / "out", tiny_kontext_path, *common, "trainer.experiment_name=aspects",
                        config="flow_grpo_flux_tiny")
    assert code == 0
    run = tmp_path / "out" / "pixelrl" / "aspects"
    val = [r for r in read_metrics(run) if "val-core/edits/reward/mean@1" in r][-1]
    assert val["val-aux/image/source_distance"] == pytest.approx(1 - val["val-core/edits/reward/mean@1"], abs=1e-6)
    dumped = sorted((run / "validation" / "step_000002").glob("*.png"))
    assert sorted(Image.open(f).size for f in dumped) == [(28, 40), (28, 40), (40, 28), (40, 28)]
    lone = _write_aspect_rows(tmp_path / "lone", [(48, 32), (32, 48)])  # two sizes, neither fills a batch
    capsys.readouterr()
    code, _ = train_cli(tmp_path / "out2", tiny_kontext_path, *common, f"data.train_files=[{lone}]",
                        "trainer.experiment_name=lone", config="flow_grpo_flux_tiny")
    err = capsys.readouterr().err
    assert code == 2 and "1 rows of 1 picture(s) at 40 x 28" in err and "rollout.output_aspect=square" in err


def test_the_same_prompt_with_two_sources_is_two_groups():
    """Groups are conditions (a uid per drawn row), not prompt strings: two rows with one
    instruction and different sources give two groups, each with its own source."""
    from pixelrl.trainers.step import expand_prompts

    sources = random_sources(4)
    request = expand_prompts(["make it blue"] * 2, [{}, {}], 3, seed=1, condition_images=sources)
    assert len(set(request["uids"][:3])) == 1 and len(set(request["uids"][3:])) == 1
    assert request["uids"][0] != request["uids"][3]
    assert request["condition_images"] == [sources[0]] * 3 + [sources[1]] * 3


def test_rows_decode_their_sources_at_the_output_size(tmp_path):
    from pixelrl.data.prompts import PromptDataset, collate_rows

    file = _write_edit_rows(tmp_path, EDIT_ROWS)
    data = PromptDataset.from_files([file], output_size=(32, 32))
    assert data.condition_counts() == {1: 5}
    batch = collate_rows([data[1], data[4]])
    (first,), (last,) = batch["condition_images"]
    assert first.shape == (32, 32, 3) and first.dtype == torch.uint8
    assert tuple(first[16, 16].tolist()) == (60, 195, 128)  # source_1's colour, resized
    assert tuple(last[0, 0].tolist()) == (0, 255, 128)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "image": "missing.png"}, "does not exist"),
    ({"prompt": "p", "image": "not_an_image.png"}, "not a readable image"),
    ({"prompt": "p", "image": "cmyk.jpg"}, "colour mode CMYK.*convert it to RGB"),
    ({"prompt": "p", "image": "tiny.png"}, "is 4 x 4; sides must be"),
    ({"prompt": "p", "image": "source_0.png", "images": ["source_1.png"]}, "both `image` and `images`"),
    ({"prompt": "p", "images": []}, "non-empty list of paths"),
    ({"prompt": "p", "image": 3}, "must be a path"),
])
def test_a_bad_condition_row_is_one_error_naming_the_file_and_row(tmp_path, row, message):
    from PIL import Image

    from pixelrl.data.prompts import DatasetError, read_prompt_file

    (tmp_path / "not_an_image.png").write_bytes(b"no picture here")
    Image.new("CMYK", (16, 16)).save(tmp_path / "cmyk.jpg")
    Image.new("RGB", (4, 4)).save(tmp_path / "tiny.png")
    file = _write_edit_rows(tmp_path, [{"prompt": "fine", "image": "source_0.png"}, row])
    with pytest.raises(DatasetError, match=rf"edits.jsonl, row 2: .*{message}"):
        read_prompt_file(file)


def test_rows_with_sources_for_a_text_to_image_family_are_refused_before_any_worker(tiny_flux_path, tmp_path, capsys):
    import re

    from conftest import train_cli

    file = _write_edit_rows(tmp_path / "data", EDIT_ROWS)
    code, _ = train_cli(tmp_path / "out", tiny_flux_path, "model.type=flux", "model.max_sequence_length=16",
                        f"data.train_files=[{file}]", "trainer.backend=local", config="flow_grpo_flux_tiny")
    assert code == 2
    assert re.search(r"data.train_files.*model.type=flux takes 0 condition.*5 rows with 1.*model.type=flux_kontext",
                     capsys.readouterr().err)
    assert not (tmp_path / "out" / "pixelrl").exists()


def test_the_sources_a_row_gives_are_checked_against_the_family(tmp_path):
    """Qwen-Image-Edit-Plus takes one to three pictures a sample, FLUX.1 Kontext one; a run's rows
    may give different numbers when each has a batch's worth of rows (a batch holds one number),
    refused by the file's field otherwise."""
    from pixelrl.config.sections import PixelRLConfig
    from pixelrl.core.errors import ConfigError
    from pixelrl.data.prompts import PromptDataset
    from pixelrl.trainers.datasets import check_conditions, check_picture_batches

    def rows(*counts):
        file = _write_edit_rows(tmp_path, [{"prompt": "p", "images": [f"source_{i}.png" for i in range(n)]}
                                           for n in counts])
        return PromptDataset.from_files([file], output_size=(32, 32))

    cfg = PixelRLConfig()
    cfg.model.type, cfg.data.train_files = "qwen_image_edit", ["edits.jsonl"]
    cfg.data.train_batch_size = 2
    check_conditions(cfg, rows(2, 2), "data.train_files")
    check_conditions(cfg, rows(3), "data.train_files")
    check_conditions(cfg, rows(1, 2, 2), "data.train_files")  # numbers may differ ...
    check_picture_batches(cfg, rows(1, 2, 2, 1))  # ... each with a batch's worth of training rows
    check_picture_batches(cfg, rows(1, 2, 2).weighted({"edits": 2}))  # counted after data.source_weights
    with pytest.raises(ConfigError, match=r"data\.train_files.*a batch holds rows of one number of pictures.*"
                                          r"1 rows with 1 picture\(s\), fewer than data\.train_batch_size=2"):
        check_picture_batches(cfg, rows(1, 2, 2))
    with pytest.raises(ConfigError, match=r"data\.train_files.*1 to 3 condition image\(s\).*1 rows with 4"):
        check_conditions(cfg, rows(4), "data.train_files")
    cfg.model.type = "flux_kontext"
    with pytest.raises(ConfigError, match=r"takes 1 condition image\(s\) per prompt.*1 rows with 2"):
        check_conditions(cfg, rows(2), "data.train_files")


def test_source_preservation_scores_the_edit_against_its_source_by_hand():
    from pixelrl.rewards import WeightedReward

    source = torch.zeros(2, 2, 3, dtype=torch.uint8)
    edited = torch.stack([source, torch.full((2, 2, 3), 255, dtype=torch.uint8), source.clone()])
    edited[2, 0] = 255  # half the pixels flipped
    reward = WeightedReward.from_functions([{"name": "source_preservation", "weight": 2.0}])
    scores = reward(edited, ["p"] * 3, [{}] * 3, [(source,)] * 3)
    assert scores["source_preservation"].tolist() == [1.0, 0.0, 0.5]
    assert scores["overall"].tolist() == [2.0, 0.0, 1.0]


def test_a_reward_that_reads_sources_is_refused_where_there_are_none(tiny_flux_path, tmp_path, capsys):
    from conftest import train_cli

    from pixelrl.core.errors import RewardError
    from pixelrl.rewards import WeightedReward

    reward = WeightedReward.from_functions([{"name": "source_preservation"}])
    with pytest.raises(RewardError, match="reward `source_preservation` reads each sample's source"):
        reward(torch.zeros(1, 2, 2, 3, dtype=torch.uint8), ["p"], [{}])
    code, _ = train_cli(tmp_path, tiny_flux_path, "model.type=flux", "model.max_sequence_length=16",
                        "trainer.backend=local", "reward.functions=[{name: source_preservation}]",
                        config="flow_grpo_flux_tiny")
    assert code == 2 and "reward.functions" in capsys.readouterr().err
    assert not (tmp_path / "pixelrl").exists()


def test_generate_edits_the_image_given_and_asks_for_one(tiny_kontext_path, tiny_flux_path, tmp_path, capsys):
    """`pixelrl generate --image` on an edit model samples edits of that source (a different source
    gives a different grid from the same seeds); an edit model without --image, and a
    text-to-image model with one, are one error naming --image."""
    import numpy as np
    from PIL import Image

    from pixelrl.cli import main

    Image.new("RGB", (48, 40), (220, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (48, 40), (30, 30, 220)).save(tmp_path / "blue.png")
    common = ["generate", "--model", str(tiny_kontext_path), "--prompt", "make it blue", "--n", "2", "--steps", "2",
              "--resolution", "32"]
    assert main([*common, "--image", str(tmp_path / "red.png"), "--out", str(tmp_path / "a.png")]) == 0
    assert main([*common, "--image", str(tmp_path / "blue.png"), "--out", str(tmp_path / "b.png")]) == 0
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "a.png")), np.asarray(Image.open(tmp_path / "b.png")))
    assert main([*common, "--out", str(tmp_path / "c.png")]) == 2
    assert "--image" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_flux_path), "--prompt", "a cat", "--image", str(tmp_path / "red.png"),
                 "--resolution", "32", "--out", str(tmp_path / "d.png")]) == 2
    assert "generates from text alone" in capsys.readouterr().err
    assert main([*common, "--image", str(tmp_path / "nowhere.png"), "--out", str(tmp_path / "e.png")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "e.png").exists()


def test_an_edit_run_on_a_rollout_pool_reproduces_the_colocated_run_bitwise(tiny_kontext_path, tmp_path):
    """The sources travel to a separate rollout worker and back with the samples: at zero staleness
    the pooled edit run's rewards and weights are the colocated run's bits (a pool that sampled
    without the sources, or with another row's, would differ)."""
    from safetensors.torch import load_file

    from conftest import read_metrics, train_cli

    file = _write_edit_rows(tmp_path / "data", EDIT_ROWS)
    common = ("model.type=flux_kontext", "model.max_sequence_length=16", f"data.train_files=[{file}]",
              "data.train_batch_size=2", "rollout.n=2", "actor.ppo_micro_batch_size=2", "trainer.backend=local",
              "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "trainer.save_freq=2",
              "reward.functions=[{name: source_preservation}]", "trainer.experiment_name=edit")
    runs = {}
    for name, extra in (("colocated", ()), ("pooled", ("rollout.n_workers=1", "trainer.mode=async",
                                                         "trainer.max_staleness=0"))):
        code, _ = train_cli(tmp_path / name, tiny_kontext_path, *common, *extra, config="flow_grpo_flux_tiny")
        assert code == 0
        runs[name] = tmp_path / name / "pixelrl" / "edit"
    rewards = {name: [m["critic/rewards/mean"] for m in read_metrics(run)] for name, run in runs.items()}
    assert rewards["colocated"] == rewards["pooled"] and len(rewards["pooled"]) == 2
    weights = {name: load_file(str(run / "checkpoints" / "global_step_2" / "actor" / "trainable.safetensors"))
               for name, run in runs.items()}
    assert all(torch.equal(weights["colocated"][k], weights["pooled"][k]) for k in weights["colocated"])


def test_an_edit_run_on_two_ray_workers_scores_its_sources_as_one_worker(ray_cluster, tiny_kontext_path, tmp_path):
    """The sources cross Ray's object store to two DDP workers (each samples and trains on its rows
    with their own sources) and the first step's rewards, sampled before any update, are one
    worker's up to float reordering."""
    from conftest import read_metrics, train_cli

    file = _write_edit_rows(tmp_path / "data", EDIT_ROWS)
    common = ("model.type=flux_kontext", "model.max_sequence_length=16", f"data.train_files=[{file}]",
              "data.train_batch_size=2", "rollout.n=2", "actor.ppo_micro_batch_size=1", "trainer.logger=[jsonl]",
              "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.experiment_name=edit",
              "reward.functions=[{name: source_preservation}]")
    rewards = {}
    for name, extra in (("one", ("trainer.backend=local",)),
                        ("two", ("trainer.backend=ray", "trainer.n_workers=2", "trainer.strategy=ddp"))):
        code, _ = train_cli(tmp_path / name, tiny_kontext_path, *common, *extra, config="flow_grpo_flux_tiny")
        assert code == 0
        rewards[name] = read_metrics(tmp_path / name / "pixelrl" / "edit")[0]["critic/rewards/mean"]
    assert 0 < rewards["one"] < 1
    assert rewards["two"] == pytest.approx(rewards["one"], rel=1e-4)


def test_the_loader_batches_each_number_of_pictures_apart_and_resumes_exactly():
    """Rows of one and two pictures: every batch holds one number, each epoch covers every whole
    batch of each number once (a number's remainder sits the epoch out) in a new order, and a
    loader restored mid-epoch from its state continues the same stream."""
    from pixelrl.data.prompts import EpochSampler

    buckets = [1, 2, 2, 1, 2, 1, 1, 2, 2, 1, 2]  # five of 1, six of 2: batches of 2 -> 2 + 3 batches
    sampler = EpochSampler(len(buckets), shuffle=True, seed=3, buckets=buckets, batch_size=2)
    assert len(sampler) == 10
    first, second = list(sampler), list(sampler)
    for order in (first, second):
        batches = [order[i:i + 2] for i in range(0, len(order), 2)]
        assert all(buckets[a] == buckets[b] for a, b in batches)
        assert sorted(buckets[a] for a, _ in batches) == [1, 1, 2, 2, 2] and len(set(order)) == 10
    assert first != second
    resumed = EpochSampler(len(buckets), shuffle=True, seed=3, buckets=buckets, batch_size=2)
    stream = iter(resumed)
    head = [next(stream) for _ in range(4)]
    state = resumed.state_dict()
    again = EpochSampler(len(buckets), shuffle=True, seed=3, buckets=buckets, batch_size=2)
    again.load_state_dict(state)
    assert head + list(again) == first


def test_a_run_of_one_and_two_picture_rows_trains_and_validates_each(tiny_qwen_edit_path, tmp_path):
    """Qwen-Image-Edit-Plus on rows of one and of two pictures: each step samples one number
    (the batches' sources say so), and validation edits both kinds of row."""
    from unittest import mock

    from conftest import read_metrics, train_cli

    from pixelrl.core.batch import Batch
    from pixelrl.workers.policy_worker import PolicyWorker

    rows = [{"prompt": f"edit {i}", "image": f"source_{i}.png"} for i in range(2)] + \
        [{"prompt": f"combine {i}", "images": ["source_0.png", f"source_{i + 1}.png"]} for i in range(2)]
    file = _write_edit_rows(tmp_path / "data", rows)
    counts = []  # the numbers of pictures of each rollout call's rows
    rollout = PolicyWorker.rollout

    def counting(self, request, *args, **kwargs):
        counts.append(sorted({len(images) for images in Batch.from_numpy(request)["condition_images"]}))
        return rollout(self, request, *args, **kwargs)

    with mock.patch.object(PolicyWorker, "rollout", counting):
        code, _ = train_cli(tmp_path / "out", tiny_qwen_edit_path, "model.type=qwen_image_edit",
                            "model.max_sequence_length=64", f"data.train_files=[{file}]", f"data.val_files=[{file}]",
                            "data.train_batch_size=2", "rollout.n=2", "actor.ppo_micro_batch_size=2",
                            "trainer.backend=local", "trainer.total_training_steps=4", "trainer.test_freq=4",
                            "trainer.save_freq=4", "trainer.experiment_name=mixed",
                            "reward.functions=[{name: source_preservation}]", config="flow_grpo_qwen_image_tiny")
    assert code == 0
    assert all(len(numbers) == 1 for numbers in counts)  # one number of pictures per call
    assert {numbers[0] for numbers in counts} == {1, 2}
    rows_metrics = read_metrics(tmp_path / "out" / "pixelrl" / "mixed")
    assert [r["step"] for r in rows_metrics if "actor/pg_loss" in r] == [1, 2, 3, 4]
    assert any(key.startswith("val-core/edits/reward") for r in rows_metrics for key in r)


def test_a_source_whose_pixel_data_is_damaged_is_refused_when_the_file_is_read(tmp_path):
    from pixelrl.data.prompts import DatasetError, read_prompt_file

    damaged_png(tmp_path / "damaged.png")
    file = _write_edit_rows(tmp_path, [{"prompt": "fine", "image": "source_0.png"},
                                       {"prompt": "p", "image": "damaged.png"}])
    with pytest.raises(DatasetError, match=r"edits.jsonl, row 2: condition image `.*damaged.png` is not a readable"):
        read_prompt_file(file)


def test_a_source_is_read_upright_as_its_exif_orientation_says(tmp_path):
    from PIL import Image

    from pixelrl.data.prompts import PromptDataset, image_size, load_condition_image

    stored = Image.new("RGB", (48, 32), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 24, 32))  # stored: red left half, blue right half
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise: red on top, 32 wide and 48 high
    stored.save(tmp_path / "turned.jpg", exif=exif, quality=95)
    assert image_size(str(tmp_path / "turned.jpg")) == (32, 48)
    upright = load_condition_image(str(tmp_path / "turned.jpg"), 48, 32)
    assert upright.shape == (48, 32, 3)
    top, bottom = upright[4, 16].tolist(), upright[44, 16].tolist()
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200 and bottom[0] < 60
    # a row of it keeps the portrait aspect the picture is shown in
    file = _write_edit_rows(tmp_path, [{"prompt": "p", "image": "turned.jpg"}])
    data = PromptDataset.from_files([file]).keeping_aspects(lambda w, h: (h, w), batch_size=1)
    (source,) = data[0]["condition_images"]
    assert source.shape == (48, 32, 3) and source[4, 16, 0] > 200


def test_the_diffusers_lines_an_edit_export_prints_edit_as_pixelrl_generate_does(tiny_kontext_path, tmp_path, capsys,
                                                                                 monkeypatch):
    """`pixelrl export` of a Kontext run prints plain diffusers lines that, run as printed beside a
    `your_source.png`, give pixelrl generate's edit of it: the prompt by keyword (as the first
    positional argument it was taken for the image), the source passed, the output kept at the
    trained area (max_area, no resize to the pipeline's preferred 1024-px sizes)."""
    import json

    import numpy as np
    from PIL import Image
    from conftest import train_cli

    from pixelrl.cli import main
    from pixelrl.cli.shapes import edit_sources
    from pixelrl.engine.evaluate import generate
    from pixelrl.models.loader import load_folder_model

    file = _write_edit_rows(tmp_path / "data", EDIT_ROWS)
    code, _ = train_cli(tmp_path / "out", tiny_kontext_path, "model.type=flux_kontext", "model.max_sequence_length=16",
                        f"data.train_files=[{file}]", "data.train_batch_size=2", "rollout.n=2",
                        "actor.ppo_micro_batch_size=2", "trainer.backend=local", "trainer.total_training_steps=1",
                        "trainer.save_freq=1", "trainer.experiment_name=edit", "actor.lr=0.05",
                        "reward.functions=[{name: source_preservation}]", config="flow_grpo_flux_tiny")
    assert code == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "out" / "pixelrl" / "edit" / "checkpoints" / "global_step_1"),
                 str(tmp_path / "exported")]) == 0
    printed = capsys.readouterr().out.split("in plain diffusers:\n", 1)[1]
    assert "prompt='make the red circle blue', image=source" in printed and "max_area=1024, _auto_resize=False" in printed
    monkeypatch.chdir(tmp_path)
    stored = np.zeros((40, 40, 3), np.uint8)
    stored[:, :20] = (220, 40, 40)
    stored[:, 20:] = (40, 40, 220)
    Image.fromarray(stored).save(tmp_path / "your_source.png")
    namespace: dict = {}
    exec("\n".join(line[4:] for line in printed.splitlines()), namespace)  # the user's copy-paste
    theirs = np.asarray(namespace["sample"], dtype=np.int16)
    model = load_folder_model(tmp_path / "exported")
    sources, size = edit_sources(model, [str(tmp_path / "your_source.png")], 1, 32)
    sampler = json.loads((tmp_path / "exported" / "pixelrl_sampler.json").read_text())
    ours = generate(model, ["make the red circle blue"], [0], num_steps=sampler["num_steps"],
                    guidance_scale=sampler["guidance_scale"], condition_images=sources, output_size=size,
                    sigma_schedule=sampler["sigma_schedule"], sigma_shift=sampler["sigma_shift"])
    assert theirs.shape == (32, 32, 3) and np.abs(theirs - ours[0].numpy().astype(np.int16)).max() <= 3
