"""The vision-language trainer on question files (`vlm.task: files`): the built-in task written to
files trains and validates exactly as the built-in task, and bad files stop the run by name."""

from __future__ import annotations

import json

import numpy as np
import torch
import pytest
from conftest import vlm_config

from pixelrl.core.errors import ConfigError
from pixelrl.shapes import qa as shapes_qa
from pixelrl.vlm import qa_files
from pixelrl.data.prompts import DatasetError


def _files_overrides(train, val):
    return ("vlm.task=files", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.prompt_key=question",
            "data.shuffle=false")


def test_the_built_in_task_written_to_files_trains_and_validates_the_same(tmp_path):
    """Two steps and a validation of the shipped model on shapes-QA, then on the same questions read
    from PNG + jsonl files (in the order the built-in task draws them): every metric equal."""
    from pixelrl.vlm.qa_tasks import task_items
    from pixelrl.vlm.trainer import VLMPPOTrainer

    common = ("model.path=builtin:shapes_qa_vlm", "trainer.total_training_steps=2", "trainer.test_freq=0",
              "trainer.val_before_train=true")
    built_in = vlm_config("builtin:shapes_qa_vlm", tmp_path / "a", *common)
    train = qa_files.write_qa_file(task_items(built_in, "train", 0, 8), tmp_path / "train.jsonl", "question")
    val = qa_files.write_qa_file(task_items(built_in, "test", 0, 12), tmp_path / "val.jsonl", "question")
    from_files = vlm_config("builtin:shapes_qa_vlm", tmp_path / "b", *common, *_files_overrides(train, val))

    drawn = task_items(from_files, "train", 0, 8) + task_items(from_files, "test", 0, 12)
    assert [it["file"] for it in drawn] == [str(train)] * 8 + [str(val)] * 12

    a, b = VLMPPOTrainer(built_in).fit(), VLMPPOTrainer(from_files).fit()
    assert [r["val/accuracy"] for r in a["val"]] == [r["val/accuracy"] for r in b["val"]]
    assert a["val"][0]["val/accuracy"] > 0  # the shipped model answers some of them right
    assert set(a["val"][0]) == set(b["val"][0]) and {"val/accuracy_colour", "val/accuracy_count"} <= set(a["val"][0])
    for row_a, row_b in zip(a["history"], b["history"], strict=True):
        for key in ("critic/rewards/answer_match/mean", "actor/pg_loss", "actor/grad_norm", *a["val"][0]):
            assert row_a.get(key) == row_b.get(key), key


def test_training_walks_every_row_once_per_epoch_in_a_fresh_order(monkeypatch):
    rows = tuple({"question": f"q{i}", "answer": "a", "type": "t", "metadata": {}, "image": None,
                  "file": "f", "row": i} for i in range(5))
    first, second = qa_files.train_order(5, 0, seed=1, shuffle=True), qa_files.train_order(5, 1, seed=1, shuffle=True)
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert qa_files.train_order(5, 0, seed=1, shuffle=True) == first  # a pure function: resume draws the same
    assert qa_files.train_order(5, 0, seed=2, shuffle=True) != first
    assert qa_files.train_order(5, 3, seed=1, shuffle=False) == list(range(5))
    # items 3..7 of the stream cross from epoch 0 into epoch 1
    monkeypatch.setattr(qa_files, "load_item", lambda row: row)
    drawn = [r["row"] for r in qa_files.train_items(rows, 3, 5, seed=1, shuffle=True)]
    assert drawn == [first[3], first[4], second[0], second[1], second[2]]


def _image_file(tmp_path, name="a.png"):
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).save(tmp_path / name)
    return name


def _write(tmp_path, rows, name="qa.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_are_read_with_their_image_metadata_and_type(tmp_path):
    image = _image_file(tmp_path)
    path = _write(tmp_path, [{"question": "what ?", "answer": 3, "image": image, "metadata": {"source": "x"}},
                             {"question": "which ?", "answer": "blue", "image": image, "type": "colour"}])
    rows = qa_files.read_qa_file(path, "question")
    assert [(r["question"], r["answer"], r["type"]) for r in rows] == [("what ?", "3", "qa"), ("which ?", "blue", "colour")]
    item = qa_files.load_item(rows[0])
    assert item["image"].shape == (20, 30, 3) and item["image"].dtype == np.uint8 and item["source"] == "x"


@pytest.mark.parametrize("row, message", [
    ({"answer": "red", "image": "a.png"}, r"row 1: `question` must be a non-empty string"),
    ({"question": "q ?", "image": "a.png"}, r"row 1: `answer` must be a non-empty string or number, got None"),
    ({"question": "q ?", "answer": "red", "image": "missing.png"}, r"row 1: `image` image .*missing.png does not exist"),
    ({"question": "q ?", "answer": "red"}, r"row 1: `image` must be an image path or image bytes"),
    ({"question": "q ?", "answer": "red", "image": "not_an_image.png"}, r"row 1: `image` image .* is not a readable image"),
])
def test_a_bad_row_names_its_file_row_and_field(tmp_path, row, message):
    _image_file(tmp_path)
    (tmp_path / "not_an_image.png").write_text("text")
    with pytest.raises(DatasetError, match=message):
        qa_files.read_qa_file(_write(tmp_path, [row]), "question")


def test_files_config_errors_stop_before_any_worker(tiny_vlm_path, tmp_path):
    from pixelrl.vlm.trainer import VLMPPOTrainer

    with pytest.raises(ConfigError, match=r"data\.train_files"):
        vlm_config(tiny_vlm_path, tmp_path, "vlm.task=files")
    with pytest.raises(ConfigError, match=r"data\.train_files.*vlm\.task=files"):
        vlm_config(tiny_vlm_path, tmp_path, "data.train_files=[x.jsonl]")  # the built-in task reads no files
    train = qa_files.write_qa_file(shapes_qa.items("train", 0, 4), tmp_path / "train.jsonl", "question")
    val = qa_files.write_qa_file(shapes_qa.items("test", 0, 6), tmp_path / "val.jsonl", "question")
    cfg = vlm_config(tiny_vlm_path, tmp_path / "run", *_files_overrides(train, val), "trainer.val_before_train=true")
    trainer = VLMPPOTrainer(cfg)
    with pytest.raises(ConfigError, match=r"vlm\.val_items.*hold 6 rows"):
        trainer.fit()
    assert trainer.actor is None and not trainer.run_dir.exists()  # nothing started, nothing written
    missing = vlm_config(tiny_vlm_path, tmp_path / "run", "vlm.task=files", f"data.train_files=[{tmp_path / 'no.jsonl'}]")
    with pytest.raises(DatasetError, match=r"no\.jsonl. does not exist: check data\.train_files"):
        VLMPPOTrainer(missing).fit()


def test_accuracy_is_reported_for_a_files_own_question_types():
    from pixelrl.vlm.pretrain import summarise_correctness

    result = summarise_correctness([("geometry", "3", 1.0), ("geometry", "4", 0.0), ("geometry", "4", 0.0),
                                    ("chart", "yes", 1.0)])
    assert result["accuracy"] == 0.5
    assert result["accuracy_geometry"] == pytest.approx(1 / 3) and result["accuracy_chart"] == 1.0
    # geometry: answer "3" right 1/1, answer "4" right 0/2 -> 0.5; chart 1.0; overall their mean
    assert result["balanced_accuracy_geometry"] == 0.5 and result["balanced_accuracy"] == 0.75


def test_validation_reads_the_answer_as_the_reward_does(tiny_vlm_path, tmp_path):
    """A model that reasons and boxes its answer: validation extracts it as the run's answer_match
    does, and compares normalised answers (a file's "Blue" is the answer "blue")."""
    from pixelrl.vlm.pretrain import answer_correctness
    from pixelrl.vlm.worker import validation_extract

    class Says:  # the policy's interface, answering with fixed text
        def prompts(self, images, questions):
            return questions

        def generate(self, prompts, **kwargs):
            return prompts

        def decode(self, batch):
            return [r"it is \boxed{blue}", "Blue", r"\boxed{4}"]

    items = [{"image": None, "question": "q", "type": "colour", "answer": "Blue"},
             {"image": None, "question": "q", "type": "colour", "answer": "Blue"},
             {"image": None, "question": "q", "type": "count", "answer": 3}]
    boxed = vlm_config(tiny_vlm_path, tmp_path, "reward.functions=[{name: answer_match, options: {extract: boxed}}]")
    assert validation_extract(boxed) == "boxed" and validation_extract(vlm_config(tiny_vlm_path, tmp_path)) == "whole"
    assert [ok for *_, ok in answer_correctness(Says(), items, extract="boxed")] == [1.0, 0.0, 0.0]
    assert [ok for *_, ok in answer_correctness(Says(), items)] == [0.0, 1.0, 0.0]


def test_image_bounds_set_the_image_tokens_per_prompt(tiny_vlm_path, tmp_path):
    """vlm.min_pixels / max_pixels override the folder's image processor: the tiny model's 32 x 32
    images are 16 tokens (8 x 8 patches of 4, merged 2 x 2); bounded to 16 x 16 pixels, 4."""
    from pixelrl.vlm.engine import VLMEngine

    image, question = shapes_qa.item("test", 0)["image"], "what colour is the circle ?"

    def image_tokens(*overrides):
        policy = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, *overrides)).policy
        ids = policy.prompts([image], [question]).input_ids[0]
        return int((ids == policy.model.config.image_token_id).sum())

    assert image_tokens() == 16
    assert image_tokens("vlm.min_pixels=256", "vlm.max_pixels=256") == 4
    with pytest.raises(ConfigError, match=r"vlm\.max_pixels.*min 1024 > max 256"):
        image_tokens("vlm.max_pixels=256")  # the folder's minimum is 32 x 32
    with pytest.raises(ConfigError, match=r"vlm\.min_pixels"):
        vlm_config(tiny_vlm_path, tmp_path, "vlm.min_pixels=512", "vlm.max_pixels=256")


@pytest.mark.parametrize("family, training", [("qwen2_vl", ("model.lora_rank=4", "model.lora_alpha=8")),
                                              ("qwen2_vl", ("model.lora_rank=0",)),
                                              ("qwen2_5_vl", ("model.lora_rank=4", "model.lora_alpha=8"))])
def test_export_writes_a_qwen2_vl_folder_that_scores_like_the_trained_policy(request, tmp_path, family, training):
    """`pixelrl export` on a vision-language checkpoint: the folder (Qwen2-VL or Qwen2.5-VL, as the
    base) loads without pixelrl's adapter and gives the trained policy's log-probs (LoRA merged, or
    full weights), not the base's: by default those of the EMA actor that the run validated, with
    `--weights actor` the actor's."""
    from pixelrl.cli import main
    from pixelrl.models.qwen_vl import QwenVLModel
    from pixelrl.vlm.trainer import VLMPPOTrainer

    tiny_vlm_path = request.getfixturevalue("tiny_vlm_path" if family == "qwen2_vl" else "tiny_vlm25_path")

    cfg = vlm_config(tiny_vlm_path, tmp_path, *training, "actor.lr=1e-2", "actor.lr_schedule=constant",
                     "vlm.ema_decay=0.5", "trainer.total_training_steps=2", "trainer.save_freq=2")
    engine = VLMPPOTrainer(cfg).fit()["engine"]
    checkpoint = tmp_path / "pixelrl" / cfg.trainer.experiment_name / "checkpoints" / "global_step_2"
    assert cfg.vlm.validate_ema  # so the EMA is what a plain export writes
    assert main(["export", str(checkpoint), str(tmp_path / "exported_ema")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "exported"), "--weights", "actor"]) == 0

    items = shapes_qa.items("test", 0, 6)

    def logprobs(model):
        batch = model.with_responses(model.prompts([it["image"] for it in items], [it["question"] for it in items]),
                                     [it["answer"] for it in items])
        return model.token_logprobs(batch)[batch.response_mask.bool()]

    trained = logprobs(engine.policy)
    with engine.ema_weights():
        ema = logprobs(engine.policy)
    exported, base = QwenVLModel(tmp_path / "exported"), QwenVLModel(tiny_vlm_path)
    assert not any("lora" in name for name, _ in exported.model.named_parameters())
    assert type(exported.model) is type(base.model)  # the family of the base, not another
    assert torch.allclose(logprobs(exported), trained, atol=1e-5)
    assert torch.allclose(logprobs(QwenVLModel(tmp_path / "exported_ema")), ema, atol=1e-5)
    assert not torch.allclose(ema, trained, atol=1e-3) and not torch.allclose(logprobs(base), trained, atol=1e-3)
    assert main(["export", str(checkpoint), str(tmp_path / "adapter"), "--adapter-only"]) == 2
    assert not (tmp_path / "adapter").exists()


def test_export_refuses_ema_weights_a_run_did_not_keep(tiny_vlm_path, tmp_path, capsys):
    from pixelrl.cli import main
    from pixelrl.vlm.trainer import VLMPPOTrainer

    cfg = vlm_config(tiny_vlm_path, tmp_path, "vlm.ema_decay=0", "vlm.validate_ema=false",
                     "trainer.total_training_steps=1", "trainer.save_freq=1")
    VLMPPOTrainer(cfg).fit()
    checkpoint = tmp_path / "pixelrl" / cfg.trainer.experiment_name / "checkpoints" / "global_step_1"
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--weights", "ema"]) == 2
    assert "kept no EMA" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_merged_state_by_hand():
    from pixelrl.core.errors import ModelFolderError
    from pixelrl.models.qwen_vl.export import merged_state

    base = {"q.weight": torch.eye(2), "k.weight": torch.zeros(2, 2)}
    trained = {"q.lora_A.default.weight": torch.tensor([[1.0, 2.0]]), "q.lora_B.default.weight": torch.tensor([[1.0], [0.0]])}
    # alpha / rank = 2: W + 2 B A = I + [[2, 4], [0, 0]]
    assert merged_state(base, trained, rank=1, alpha=2.0)["q.weight"].tolist() == [[3.0, 4.0], [0.0, 1.0]]
    assert merged_state(base, {"k.weight": torch.ones(2, 2)}, rank=1, alpha=1.0)["k.weight"].tolist() == [[1.0] * 2] * 2
    with pytest.raises(ModelFolderError, match="`v.weight` is not in the base model"):
        merged_state(base, {"v.weight": torch.ones(2, 2)}, rank=1, alpha=1.0)
    with pytest.raises(ModelFolderError, match="no B factor"):
        merged_state(base, {"q.lora_A.default.weight": torch.ones(1, 2)}, rank=1, alpha=1.0)


def test_a_parquet_file_with_image_bytes_reads_like_jsonl_with_paths(tmp_path):
    """An exported Hugging Face image column ({"bytes": ...}) in parquet gives the same items as the
    PNG files it was made from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = qa_files.write_qa_file(shapes_qa.items("test", 0, 3), tmp_path / "qa.jsonl", "question")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["image"] = {"bytes": (tmp_path / row["image"]).read_bytes(), "path": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    from_jsonl = [qa_files.load_item(r) for r in qa_files.read_qa_file(path, "question")]
    from_parquet = [qa_files.load_item(r) for r in qa_files.read_qa_file(tmp_path / "qa.parquet", "question")]
    for a, b in zip(from_jsonl, from_parquet, strict=True):
        assert (a["question"], a["answer"], a["type"]) == (b["question"], b["answer"], b["type"])
        assert np.array_equal(a["image"], b["image"])
    assert np.array_equal(from_jsonl[0]["image"], shapes_qa.item("test", 0)["image"])  # PNG is lossless


def test_demo_vlm_prints_a_question_files_own_types(tiny_vlm_path, tmp_path, capsys):
    from pixelrl.cli import main

    items = [{**it, "type": "scenes"} for it in shapes_qa.items("test", 0, 4)]
    train = qa_files.write_qa_file(shapes_qa.items("train", 0, 4), tmp_path / "train.jsonl", "question")
    val = qa_files.write_qa_file(items, tmp_path / "val.jsonl", "question")
    assert main(["demo-vlm", f"model.path={tiny_vlm_path}", f"trainer.default_local_dir={tmp_path}",
                 *_files_overrides(train, val), "data.train_batch_size=4", "rollout.n=2",
                 "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "vlm.val_items=4",
                 "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 "trainer.backend=local", "trainer.n_workers=1"]) == 0
    out = capsys.readouterr().out
    assert "question files" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["scenes"], ["overall"])}
    assert set(rows) == {"scenes", "overall"} and rows["scenes"][-1] == "-"  # no colour-only reference here


def test_eval_vlm_scores_a_folder_on_question_files_as_validation_does(tmp_path, capsys):
    """`pixelrl eval-vlm` on the shipped model: the shapes-QA test questions written to files score
    what the built-in questions score, per type; a bad --model names the argument."""
    from pixelrl.cli import main

    val = qa_files.write_qa_file([{**it, "type": "scenes"} if i % 2 else it
                                  for i, it in enumerate(shapes_qa.items("test", 0, 30))], tmp_path / "val.jsonl")
    assert main(["eval-vlm", "--items", "30", "--out", str(tmp_path / "builtin.json")]) == 0
    assert main(["eval-vlm", "--files", str(val), "--question-key", "prompt", "--out", str(tmp_path / "files.json")]) == 0
    out = capsys.readouterr().out
    builtin, files = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("builtin", "files"))
    assert builtin["questions"] == files["questions"] == 30 and builtin["accuracy"] == files["accuracy"] > 0
    assert "accuracy_scenes" in files and "scenes" in out  # a file's own types are reported
    assert main(["eval-vlm", "--model", str(tmp_path)]) == 2
    assert "`--model`" in capsys.readouterr().err


def test_ptx_trains_on_its_own_files_and_is_refused_without_them(tiny_vlm_path, tmp_path, ptx_file, monkeypatch):
    """vlm.ptx_coef's supervised loss reads (image, question, answer) rows of vlm.ptx_files (as
    LightRFT's ptx is a pretraining set of its own), never the RL questions' answers; the rows a
    call draws depend only on (seed, step, rank, call), so a resumed run draws the same."""
    from pixelrl.vlm.engine import VLMEngine

    with pytest.raises(ConfigError, match="vlm.ptx_files"):
        vlm_config(tiny_vlm_path, tmp_path, "vlm.ptx_coef=0.1")
    with pytest.raises(ConfigError, match="vlm.ptx_files"):
        vlm_config(tiny_vlm_path, tmp_path, f"vlm.ptx_files=[{ptx_file}]")
    cfg = vlm_config(tiny_vlm_path, tmp_path, "vlm.ptx_coef=0.1", f"vlm.ptx_files=[{ptx_file}]")
    engine = VLMEngine(cfg)
    seen = []
    real = engine.policy.with_responses
    monkeypatch.setattr(engine.policy, "with_responses", lambda prompts, answers: seen.append(answers) or real(prompts, answers))
    first = engine._ptx_loss(6, step=3, call=0)
    again = engine._ptx_loss(6, step=3, call=0)
    engine._ptx_loss(6, step=4, call=0)
    file_answers = {str(it["answer"]) for it in shapes_qa.items("val", 0, 16)}
    assert all(set(a) <= file_answers for a in seen) and len(seen[0]) == 6
    assert seen[0] == seen[1] and float(first.detach()) == float(again.detach())  # the same draw for the same (step, call)
    assert seen[2] != seen[0]
    assert torch.isfinite(first) and first.requires_grad


def test_ptx_on_plain_text_trains_every_token_of_it(tiny_vlm_path, tmp_path, ptx_file):
    """Plain pretraining text (LightRFT's pretrain mode): the loss is the mean negative log-likelihood
    of every token after the first (EOS included), no image, no chat template, padding left out:
    checked against a forward of the model written out here. A .txt file and a .jsonl of `text`
    rows are the same set; a set mixing text and question files is refused naming the field."""
    import json

    from pixelrl.vlm import qa_files
    from pixelrl.vlm.engine import VLMEngine

    texts = ["a red circle above two blue squares", "three green triangles"]
    (tmp_path / "text.txt").write_text("\n".join(texts) + "\n\n")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    engine = VLMEngine(vlm_config(tiny_vlm_path, tmp_path, "vlm.ptx_coef=0.1", f"vlm.ptx_files=[{tmp_path / 'text.txt'}]"))
    policy = engine.policy
    nll, tokens = 0.0, 0
    for text in texts:
        ids = torch.tensor([policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [policy.eos_id]])
        with torch.no_grad():
            logits = policy.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logits[:, policy.suppressed_ids] = float("-inf")
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])
        nll, tokens = nll - float(logp.sum()), tokens + ids.shape[1] - 1
    logp, mask = policy.text_logprobs(texts)
    assert float(-(logp.detach() * mask).sum() / mask.sum()) == pytest.approx(nll / tokens, rel=1e-5)
    assert mask.sum() == tokens and mask[1].sum() < mask[0].sum()  # the shorter text's padding is left out
    draws = engine._ptx_loss(8, step=1, call=0)
    assert draws.requires_grad and torch.isfinite(draws)
    rows_txt = qa_files.open_ptx_files((str(tmp_path / "text.txt"),), "prompt")
    rows_jsonl = qa_files.open_ptx_files((str(tmp_path / "text.jsonl"),), "prompt")
    assert [r["text"] for r in rows_txt] == [r["text"] for r in rows_jsonl] == texts
    with pytest.raises(qa_files.DatasetError, match=r"vlm\.ptx_files mixes plain text"):
        qa_files.open_ptx_files((str(tmp_path / "text.txt"), str(ptx_file)), "prompt")
