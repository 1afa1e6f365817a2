"""The shapes-editing world: triples, the judge and its reward, the shipped rows, pretraining of
the FLUX.1 Kontext-layout editing model."""

import json

import numpy as np
import pytest
import torch

from pixelrl.shapes import edit_world
from pixelrl.shapes.detector import Detection


def test_every_edit_has_a_target_that_passes_and_a_source_that_fails():
    items = edit_world.evaluation_items("train", per_edit=12) + edit_world.evaluation_items("test", per_edit=12)
    for item in items:
        source, target, metadata = edit_world.edit_triple(item, item["seed"])
        assert edit_world.score_edit(target, metadata)["exact"], item
        verdict = edit_world.score_edit(source, metadata)
        assert not verdict["exact"] and not verdict["followed"], item
        assert verdict["kept"] == 1.0, item  # the source holds every untouched object where it was
    # deterministic: the same instruction and seed give the same scene
    again = edit_world.edit_triple(items[0], items[0]["seed"])
    assert np.array_equal(again[0], edit_world.edit_triple(items[0], items[0]["seed"])[0])


def _found(shape, colour, cx, cy):
    return Detection(shape, colour, 40, cx, cy, 0.8, 0.9)


def test_the_judge_by_hand():
    recolour = {"keep": [{"shape": "triangle", "colour": "red", "cx": 10.0, "cy": 10.0, "rule": "at"}],
                "edited": [{"shape": "square", "colour": "cyan", "cx": 20.0, "cy": 20.0, "rule": "at"}], "removed": []}
    done = edit_world.score_detections([_found("triangle", "red", 12.5, 10.0), _found("square", "cyan", 20, 22)],
                                       recolour, 32)
    assert done == {"kept": 1.0, "followed": True, "extra_objects": 0, "exact": True, "partial": 1.0}
    # the square left in its old colour: not followed, and the old square is an object nobody asked for
    old = edit_world.score_detections([_found("triangle", "red", 10, 10), _found("square", "blue", 20, 20)], recolour, 32)
    assert (old["followed"], old["exact"], old["extra_objects"], old["kept"]) == (False, False, 1, 1.0)
    assert old["partial"] == pytest.approx(1 / 3)  # one of two checks, over two checks plus one extra
    # the triangle drifted 3.5 px: not kept
    drifted = edit_world.score_detections([_found("triangle", "red", 13.5, 10), _found("square", "cyan", 20, 20)],
                                          recolour, 32)
    assert drifted["kept"] == 0.0 and drifted["followed"] and not drifted["exact"] and drifted["extra_objects"] == 1

    move = {"keep": [], "removed": [], "edited": [{"shape": "circle", "colour": "red", "cx": 16.0, "cy": 16.0,
                                                   "rule": "left"}]}
    judged = lambda cx, cy: edit_world.score_detections([_found("circle", "red", cx, cy)], move, 32)["exact"]  # noqa: E731
    assert judged(12.0, 16.0) and judged(5.0, 18.9)
    assert not judged(12.5, 16.0)  # moved 3.5 px: less than MOVE_MIN
    assert not judged(8.0, 19.5)  # and down as well
    assert not judged(20.0, 16.0)  # the wrong way
    # the same scales with the image: at 64 px the distances double
    assert edit_world.score_detections([_found("circle", "red", 24.0, 32.0)], move, 64)["exact"]
    assert not edit_world.score_detections([_found("circle", "red", 25.0, 32.0)], move, 64)["exact"]

    remove = {"keep": [], "edited": [], "removed": [{"shape": "square", "colour": "red", "cx": 8.0, "cy": 8.0,
                                                     "rule": "at"}]}
    still = edit_world.score_detections([_found("square", "red", 8, 9)], remove, 32)
    assert (still["followed"], still["extra_objects"], still["partial"]) == (False, 1, 0.0)
    assert edit_world.score_detections([], remove, 32)["exact"]

    # two of three copies kept, either two: each kept copy at one of the places
    places = [[6.0, 6.0], [16.0, 16.0], [26.0, 26.0]]
    count = {"keep": [], "removed": [], "edited": [{"shape": "circle", "colour": "blue", "rule": "one_of",
                                                    "places": places}] * 2}
    for pair in ([0, 1], [0, 2], [1, 2]):
        assert edit_world.score_detections([_found("circle", "blue", *places[i]) for i in pair], count, 32)["exact"]
    three = edit_world.score_detections([_found("circle", "blue", *p) for p in places], count, 32)
    assert not three["exact"] and three["extra_objects"] == 1
    elsewhere = edit_world.score_detections([_found("circle", "blue", 6, 6), _found("circle", "blue", 6, 26)], count, 32)
    assert not elsewhere["followed"]

    # an added object is claimed after the placed ones: a copy at a kept place cannot pass for it
    add = {"keep": [{"shape": "circle", "colour": "red", "cx": 8.0, "cy": 8.0, "rule": "at"}], "removed": [],
           "edited": [{"shape": "circle", "colour": "red", "cx": 20.0, "cy": 20.0, "rule": "free"}]}
    assert edit_world.score_detections([_found("circle", "red", 26, 5), _found("circle", "red", 8, 8)], add, 32)["exact"]
    assert not edit_world.score_detections([_found("circle", "red", 8, 8)], add, 32)["followed"]


def test_instructions_split_without_overlap_and_the_shipped_rows_are_the_generators(tmp_path):
    from pixelrl.core.assets import BUILTIN

    splits = {name: {item["prompt"] for item in items} for name, items in edit_world.instruction_splits().items()}
    assert not (splits["train"] & splits["test"]) and not (splits["train"] & splits["val"])
    assert not (splits["val"] & splits["test"])
    for items in edit_world.all_instructions().values():  # every kind held out in part
        assert any(item["prompt"] in splits["test"] for item in items)
    for split, per_edit in (("train", 128), ("val", 16)):
        shipped = BUILTIN[f"shapes_edit/{split}"]
        written = edit_world.write_rows(tmp_path, split, per_edit)
        assert written.read_text() == shipped.read_text()
        rows = [json.loads(line) for line in shipped.read_text().splitlines()]
        assert all(row["prompt"] in splits[split] for row in rows)
        for row in rows[::37]:
            assert (shipped.parent / row["image"]).read_bytes() == (tmp_path / row["image"]).read_bytes()


def test_the_reward_pays_the_exact_edit_and_needs_the_rows_metadata():
    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards.registry import check_reward_options, get_reward

    items = edit_world.evaluation_items("val", per_edit=2)
    triples = [edit_world.edit_triple(item, item["seed"]) for item in items]
    sources = torch.from_numpy(np.stack([t[0] for t in triples]))
    targets = torch.from_numpy(np.stack([t[1] for t in triples]))
    metadata = [t[2] for t in triples]
    prompts = [item["prompt"] for item in items]
    exact = get_reward("shapes_edit", exact_weight=1.0)
    assert exact(targets, prompts, metadata)["shapes_edit"].tolist() == [1.0] * len(items)
    on_sources = exact(sources, prompts, metadata)
    assert on_sources["shapes_edit"].tolist() == [0.0] * len(items)
    assert on_sources["edit_kept"].tolist() == [1.0] * len(items)
    partial = get_reward("shapes_edit")(sources, prompts, metadata)["shapes_edit"]
    expected = [edit_world.score_edit(s, m)["partial"] for s, m in zip(sources.numpy(), metadata)]
    assert partial.tolist() == pytest.approx(expected) and 0 < float(partial.mean()) < 1
    with pytest.raises(ValueError, match="edit metadata"):
        exact(targets, prompts, [{}] * len(items))
    with pytest.raises(ConfigError, match="exact_weight"):
        check_reward_options("shapes_edit", {"exact_weight": 2}, "reward.functions[0].options")


def test_the_careful_judge_passes_clean_edits_and_rejects_a_speck():
    from scipy import ndimage

    from pixelrl.shapes.edit_evaluate import judge_edit

    for item in edit_world.evaluation_items("test", per_edit=4):
        source, target, metadata = edit_world.edit_triple(item, item["seed"])
        clean = judge_edit(target, metadata, source)
        assert clean["exact"] and clean["careful"], item
        assert clean["pixels_kept"] == pytest.approx(1 - np.abs(target.astype(float) - source).mean() / 255)
        specked = target.copy()
        # six white pixels two pixels clear of any object (the judge forgives an object's rim)
        near = ndimage.binary_dilation(target.max(axis=-1) > 0, structure=np.ones((3, 3)), iterations=2)
        for y, x in np.argwhere(~near)[:6]:
            specked[y, x] = 255
        verdict = judge_edit(specked, metadata, source)
        assert verdict["exact"] and not verdict["careful"] and verdict["careful_reason"] == "stray pixels"


TINY_EDIT_ARCH = dict(resolution=32, text_hidden=16, text_max_length=16, num_layers=1, num_single_layers=1, heads=2,
                      head_dim=16, guidance_embeds=False)


def test_edit_pretraining_writes_a_kontext_pipeline_and_resumes_bitwise(tmp_path, monkeypatch):
    """The editing world's pretraining (its VAE shortened): a FLUX.1 Kontext folder that diffusers'
    pipeline loads and pixelrl samples edits from; 4 steps in one call == 2, stop, 2 more."""
    from diffusers import FluxKontextPipeline
    from safetensors.torch import load_file

    from pixelrl.models.flux_kontext import FluxKontextModel
    from pixelrl.shapes import pretrain_edit
    from pixelrl.shapes.edit_evaluate import evaluate_edits
    from pixelrl.shapes.pretrain import pretrain_shapes

    monkeypatch.setattr(pretrain_edit, "VAE_STEPS", 4)
    kwargs = dict(world="edit", batch_size=4, lr=3e-3, warmup=3, eval_every=2, eval_per_category=1,
                  arch=TINY_EDIT_ARCH, log=lambda line: None)
    final = pretrain_shapes(tmp_path / "whole", steps=4, **kwargs)
    pretrain_shapes(tmp_path / "split", steps=2, **kwargs)
    pretrain_shapes(tmp_path / "split", steps=4, **kwargs)
    whole = load_file(tmp_path / "whole" / "state" / "weights.safetensors")
    split = load_file(tmp_path / "split" / "state" / "weights.safetensors")
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    records = [json.loads(line) for line in (tmp_path / "whole" / "pretrain_log.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4 and 0 <= records[-1]["val_exact"] <= records[-1]["val_followed"] <= 1

    assert FluxKontextPipeline.from_pretrained(final).transformer.config.in_channels == 16
    assert json.loads((final / "pixelrl_model.json").read_text()) == {"max_sequence_length": 16}
    model = FluxKontextModel(final, max_sequence_length=16)
    scale = model.vae.config.scaling_factor
    assert scale != 1.0  # set from the trained VAE's latents
    result = evaluate_edits(model, edit_world.evaluation_items("test", per_edit=1), num_steps=2)
    assert result["images"].shape == (5, 32, 32, 3) and set(result["exact_by_edit"]) == set(edit_world.EDITS)


def test_the_edit_demo_runs_end_to_end_and_writes_its_summary(tmp_path, capsys):
    """`pixelrl demo-edit` on the shipped editing model, shortened: per-kind tables with intervals,
    the paired gains, the grid (source, base, trained) and the run report."""
    from pixelrl.cli import main

    assert main(["demo-edit", "--per-edit", "2", f"trainer.default_local_dir={tmp_path}", "trainer.backend=local",
                 "trainer.n_workers=1", "trainer.total_training_steps=2", "data.train_batch_size=2", "rollout.n=4",
                 "actor.ppo_micro_batch_size=8", "trainer.save_freq=2"]) == 0
    printed = capsys.readouterr().out
    assert "| model (exact) | overall | recolour | remove | add | move | count |" in printed
    assert "| after 2 steps |" in printed and "edit succeeded (exact): " in printed
    assert "paired 95% interval" in printed and "source pixels kept: " in printed
    run = tmp_path / "pixelrl" / "shapes_edit_demo"
    summary = json.loads((run / "demo_summary.json").read_text())
    assert set(summary["before"]["exact_by_edit"]) == set(edit_world.EDITS)
    assert summary["evaluated_checkpoint"].endswith("global_step_2")
    from PIL import Image

    grid = Image.open(run / "source_base_trained.png")
    assert grid.size[0] == 8 * 32 * 3  # eight edits a row (two per kind), three bands
    page = (run / "report.html").read_text()
    assert "<th>model (exact)</th>" in page and 'alt="source_base_trained.png"' in page


def test_eval_scores_an_editing_model_per_kind_of_edit(tmp_path, capsys):
    from pixelrl.cli import main

    out = tmp_path / "edit.json"
    assert main(["eval", "--task", "edit", "--per-category", "2", "--steps", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for score in ("exact", "followed", "kept", "careful"):
        assert f"| model ({score}) | overall | recolour | remove | add | move | count |" in printed
    assert "| builtin:shapes_edit | " in printed and "10 edits (test split)" in printed
    # the size is the world's, not "as given" (no --resolution was): only --steps was given
    assert "(the editing world's scenes' size; the rest the model folder's defaults; --steps as given)" in printed
    result = json.loads(out.read_text())
    assert result["num_images"] == 10 and result["model"] == "builtin:shapes_edit" and result["num_steps"] == 3
    low, high = result["exact_interval"]
    assert low <= result["exact"] <= high and set(result["exact_by_edit"]) == set(edit_world.EDITS)
    # paired against itself: every verdict's gain is 0 in a [0, 0] interval, and the pair is recorded
    paired = tmp_path / "paired.json"
    assert main(["eval", "--task", "edit", "--per-category", "2", "--steps", "3", "--baseline", str(out),
                 "--out", str(paired)]) == 0
    printed = capsys.readouterr().out
    assert f"edit succeeded (exact): {result['exact']:.3f} -> {result['exact']:.3f} (+0.000, paired 95% interval " \
           "[+0.000, +0.000])" in printed and "source pixels kept: " in printed
    assert json.loads(paired.read_text())["paired"] == {"baseline": str(out), "exact_gain_interval": [0.0, 0.0]}
    # a baseline of other items, or sampled otherwise, is refused before anything is sampled
    for extra, message in ((["--per-category", "1"], "scored on other items"),
                           (["--per-category", "2", "--steps", "2"], "sampled with num_steps = 3")):
        assert main(["eval", "--task", "edit", *extra, "--baseline", str(out), "--out", str(tmp_path / "x.json")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_what_the_edit_reward_needs_of_a_rows_metadata_by_hand():
    from pixelrl.data.prompts import PromptDataset
    from pixelrl.shapes.edit_world import edit_metadata_problem

    shipped = PromptDataset.from_files(["builtin:shapes_edit/train"])
    assert not any(edit_metadata_problem(row["metadata"]) for row in shipped.rows)  # every kind of rule
    keep = {"shape": "circle", "colour": "red", "rule": "at", "cx": 8, "cy": 8}
    assert edit_metadata_problem({"keep": [keep], "edited": [], "removed": []}) == ""
    assert "no `removed` list" in edit_metadata_problem({"keep": [keep], "edited": []})
    assert "without shape, colour, cx, cy" in edit_metadata_problem(
        {"keep": [{k: v for k, v in keep.items() if k != "cy"}], "edited": [], "removed": []})
    assert "without shape, colour, places" in edit_metadata_problem(
        {"keep": [], "edited": [{"shape": "star", "colour": "red", "rule": "one_of"}], "removed": []})
    assert "known `rule`" in edit_metadata_problem({"keep": [{**keep, "rule": "near"}], "edited": [], "removed": []})


def test_what_the_scene_reward_needs_of_a_rows_metadata_by_hand():
    from pixelrl.shapes.detector import scene_metadata_problem
    from pixelrl.shapes.world import evaluation_items

    assert not any(scene_metadata_problem(it["metadata"]) for it in evaluation_items("test", per_category=4))
    circle = {"shape": "circle", "colour": None, "count": 1}
    assert scene_metadata_problem({"category": "single_object", "objects": [circle]}) == ""
    assert "no `objects` list" in scene_metadata_problem({"category": "single_object"})
    assert "without shape, colour and count" in scene_metadata_problem({"category": "x", "objects": [{"shape": "c"}]})
    assert "no `category`" in scene_metadata_problem({"objects": [circle]})
