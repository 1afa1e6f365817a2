"""The shapes world's text task: renders the OCR reward reads, prompts the tokenizer keeps whole,
evaluation splits, and pretraining on it."""

import numpy as np
import pytest
import torch

from pixelrl.shapes import text as shapes_text
from pixelrl.rewards import RewardSpec, WeightedReward


def test_every_word_renders_legibly_at_32_px():
    """The task is solvable: on clean 32 px renders of every word (random colour, jittered size and
    place) the OCR reward reads all exactly (24 of 24 at this seed, 96 of 96 over seeds 7-10; one
    misread is allowed for engine updates), and a blank canvas scores 0."""
    items = shapes_text.prompt_items()
    images = torch.from_numpy(np.stack([shapes_text.render(it["metadata"]["text"], seed=7) for it in items]))
    prompts = [it["prompt"] for it in items]
    reward = WeightedReward([RewardSpec("ocr")])
    scores = reward(images, prompts, [it["metadata"] for it in items])["ocr"]
    assert (scores == 1.0).sum() >= 23 and scores.mean() > 0.95
    blank = reward(torch.zeros_like(images[:2]), prompts[:2], [{}, {}])["ocr"]
    assert blank.tolist() == [0.0, 0.0]


def test_every_word_fits_the_canvas_at_every_size():
    """Wide words at the largest font size are set smaller, never cut off: the ink stays off the
    one-pixel border for every word over many seeds."""
    for word in shapes_text.WORDS:
        for seed in range(40):
            image = shapes_text.render(word, seed).astype(int).sum(-1)
            assert image[[0, -1], :].max() < 40 and image[:, [0, -1]].max() < 40, (word, seed)


def test_renders_are_deterministic_and_vary_with_the_seed():
    a, b, c = (shapes_text.render("sun", seed) for seed in (3, 3, 4))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.max() > 150 and (a.sum(-1) == 0).mean() > 0.5  # coloured strokes on the black canvas


def test_prompts_quote_the_word_and_tokenise_into_whole_words():
    from pixelrl.models.tiny import build_clip_tokenizer
    from pixelrl.rewards.ocr import quoted_target

    tokenizer = build_clip_tokenizer(shapes_text.vocabulary(), max_length=16)
    for item in shapes_text.prompt_items():
        word = item["metadata"]["text"]
        assert quoted_target(item["prompt"]) == word
        tokens = tokenizer.tokenize(item["prompt"])
        assert tokens == ["a</w>", "sign</w>", "that</w>", "says</w>", '"</w>', f"{word}</w>", '"</w>']


def test_shipped_prompt_file_matches_the_generator():
    import json

    from pixelrl.core.assets import BUILTIN

    shipped = [json.loads(line) for line in BUILTIN["shapes_text/words"].read_text().splitlines()]
    items = shapes_text.prompt_items()
    assert [(r["prompt"], r["metadata"]) for r in shipped] == [(it["prompt"], it["metadata"]) for it in items]


def test_validation_and_test_items_cover_every_word_with_their_own_seeds():
    val, test = shapes_text.evaluation_items("val"), shapes_text.evaluation_items("test")
    assert len(val) == len(shapes_text.WORDS) * shapes_text.VAL_SEEDS
    assert len(test) == len(shapes_text.WORDS) * shapes_text.TEST_SEEDS
    assert {it["metadata"]["text"] for it in val} == {it["metadata"]["text"] for it in test} == set(shapes_text.WORDS)
    assert not {it["seed"] for it in val} & {it["seed"] for it in test}
    with pytest.raises(ValueError, match="val or test"):
        shapes_text.evaluation_items("train")


@pytest.mark.slow
def test_pretraining_on_the_text_world_writes_a_pipeline_and_logs_ocr(tmp_path):
    import json

    from pixelrl.shapes.pretrain import SHAPES_ARCH, pretrain_shapes

    arch = dict(SHAPES_ARCH, num_layers=1, heads=2, head_dim=16)
    final = pretrain_shapes(tmp_path / "run", steps=2, eval_every=2, world="text", batch_size=4, warmup=1,
                            arch=arch, log=lambda line: None)
    assert (final / "model_index.json").is_file()
    record = [json.loads(line) for line in (tmp_path / "run" / "pretrain_log.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 2 and 0.0 <= record["val_ocr_exact"] <= record["val_ocr"] <= 1.0
    vocab = (final / "tokenizer" / "tokenizer.json").read_text()
    assert '"sun</w>"' in vocab and '"circle</w>"' not in vocab  # the text world's words, not the scenes'


def test_eval_text_command_scores_ocr_per_item_with_intervals(tmp_path, tiny_pixel_path, capsys, monkeypatch):
    """`pixelrl eval --task text`: every item's image is scored by the OCR reward; clean renders
    for half the items and blank images for the rest give rows of ~1 and exactly 0, and the overall
    figures are their means with a bootstrap interval around them."""
    import json

    import pixelrl.shapes.evaluate as evaluate
    from pixelrl.cli import main

    def fake_generate(model, prompts, seeds, **kwargs):  # the model's sampler is tested elsewhere
        words = [p.split('"')[1] for p in prompts]
        images = [shapes_text.render(w, s) if i % 2 == 0 else np.zeros((32, 32, 3), np.uint8)
                  for i, (w, s) in enumerate(zip(words, seeds))]
        return torch.from_numpy(np.stack(images))

    monkeypatch.setattr(evaluate, "generate", fake_generate)
    out = tmp_path / "text.json"
    assert main(["eval", "--task", "text", "--model", str(tiny_pixel_path), "--split", "val", "--per-category", "1",
                 "--out", str(out)]) == 0
    assert "| model | ocr | exactly readable |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["items"]
    assert len(rows) == len(shapes_text.WORDS) and {r["category"] for r in rows} == {"text"}
    assert all(r["ocr"] == 0.0 for r in rows[1::2]) and np.mean([r["ocr"] for r in rows[0::2]]) > 0.9
    assert result["ocr"] == pytest.approx(np.mean([r["ocr"] for r in rows]))
    assert result["exact"] == pytest.approx(np.mean([r["ocr"] == 1.0 for r in rows]))
    assert main(["eval", "--task", "text", "--split", "train"]) == 2  # before any model loads
    assert "--split" in capsys.readouterr().err


def test_the_shipped_text_model_draws_words_the_ocr_engine_partly_reads(tmp_path, capsys):
    """`pixelrl eval --task text` defaults to builtin:shapes_text, which is loaded with the options
    its folder declares (zero T5 tokens) and reads between the figures its model card gives for
    a base that RL can improve: some words whole, most in part."""
    import json

    from pixelrl.cli import main

    out = tmp_path / "text.json"
    assert main(["eval", "--task", "text", "--split", "val", "--per-category", "1", "--out", str(out)]) == 0
    assert "| builtin:shapes_text |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert 0.4 <= result["ocr"] <= 0.85 and 0.1 <= result["exact"] <= 0.6, result
