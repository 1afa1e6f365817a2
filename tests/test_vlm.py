"""The vision-language path: the Qwen2-VL adapter, the VLM engine, its trainer and checkpoints."""

from pathlib import Path

import pytest
import torch
from conftest import assert_learned, record_learning, vlm_config, vlm_run_killed_after_checkpoint

from pixelrl.vlm import token_losses as T
from pixelrl.core.config_io import to_yaml
from pixelrl.core.errors import ConfigError
from pixelrl.shapes import qa as shapes_qa
from pixelrl.models.qwen_vl import QwenVLModel, response_mask_from


@pytest.fixture
def tiny_vlm(any_tiny_vlm_path):
    """The adapter on each tiny family in turn (Qwen2-VL, Qwen2.5-VL)."""
    return QwenVLModel(any_tiny_vlm_path)


def test_response_mask_ends_at_the_first_eos():
    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 9, 2, 0]])
    assert response_mask_from(responses, eos_id=2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_a_prompt_spells_every_chat_token_as_one_token(tiny_vlm):
    from pixelrl.models.qwen_vl.tiny import IM_END, IM_START, IMAGE_PAD, VISION_END, VISION_START

    it = shapes_qa.item("val", 1)  # a colour question: "what colour is the <shape> ?"
    prompts = tiny_vlm.prompts([it["image"]], [it["question"]])
    tokens = tiny_vlm.tokenizer.convert_ids_to_tokens(prompts.input_ids[0].tolist())
    # a 32 px image is 16 merged patches
    assert tokens == [IM_START, "user", VISION_START, *[IMAGE_PAD] * 16, VISION_END, *it["question"].split(),
                      IM_END, IM_START, "assistant"]


def test_generation_log_probs_equal_the_training_forward(tiny_vlm):
    items = shapes_qa.items("train", 0, 6)  # three question types: prompts of different lengths
    prompts = tiny_vlm.prompts([it["image"] for it in items], [it["question"] for it in items])
    assert (prompts.attention_mask == 0).any(), "the batch should hold left padding"
    out = tiny_vlm.generate(prompts, seed=3, temperature=1.0, max_new_tokens=5)
    logp = tiny_vlm.token_logprobs(out)
    assert logp.shape == out.response_mask.shape
    torch.testing.assert_close(logp, out.extra["rollout_logp"], atol=2e-5, rtol=0)
    # a row scored alone equals the same row scored in the padded batch
    for row in range(len(items)):
        alone = tiny_vlm.token_logprobs(out.select([row]))
        torch.testing.assert_close(alone[0], logp[row], atol=2e-5, rtol=0)


def test_padding_and_prompt_never_reach_a_loss(tiny_vlm):
    items = shapes_qa.items("train", 0, 4)
    prompts = tiny_vlm.prompts([it["image"] for it in items], [it["question"] for it in items])
    batch = tiny_vlm.with_responses(prompts, ["red", "how many are there", "yes", "two"])
    mask = batch.response_mask
    assert mask.sum(1).tolist() == [2, 5, 2, 2] and mask.shape[1] == 5  # answer tokens + EOS, right padded
    changed = batch.input_ids.clone()
    pad_cols = (mask == 0).nonzero()
    changed[pad_cols[:, 0], batch.prompt_length + pad_cols[:, 1]] = 11  # garbage after the end
    other = type(batch)(**{**batch.__dict__, "input_ids": changed})
    logp, logp2 = tiny_vlm.token_logprobs(batch), tiny_vlm.token_logprobs(other)
    assert (logp[mask == 0] == 0).all()
    torch.testing.assert_close(logp, logp2)
    adv = torch.randn(mask.shape)
    old = logp.detach() + 0.1 * torch.randn(mask.shape)
    for agg in T.AGGREGATIONS:
        a = T.ppo_policy_loss(logp, old, adv, mask, aggregation=agg)[0]
        b = T.ppo_policy_loss(logp2, old + 50 * (1 - mask), adv + 50 * (1 - mask), mask, aggregation=agg)[0]
        torch.testing.assert_close(a, b)
    assert T.ptx_loss(logp, mask) == T.ptx_loss(logp2, mask)


def test_vision_placeholders_are_never_sampled(tiny_vlm):
    items = shapes_qa.items("train", 0, 16)
    prompts = tiny_vlm.prompts([it["image"] for it in items], [it["question"] for it in items])
    out = tiny_vlm.generate(prompts.select(torch.arange(16).repeat(4)), seed=0, temperature=20.0, max_new_tokens=6)
    sampled = out.responses[out.response_mask > 0]
    assert sampled.numel() > 200
    assert not torch.isin(sampled, torch.tensor(tiny_vlm.suppressed_ids)).any()


def test_vlm_config_errors_name_the_field(tiny_vlm_path, tmp_path):
    for override, field in (("vlm.estimator=ppo", "vlm.estimator"), ("vlm.dual_clip=0.5", "vlm.dual_clip"),
                            ("rollout.n=1", "rollout.n"), ("vlm.freezing_actor_steps=3", "vlm.freezing_actor_steps"),
                            ("vlm.kl_target=0.1", "vlm.kl_coef"), ("actor.ppo_mini_batch_size=5", "actor.ppo_mini_batch_size"),
                            ("model.path=/nonexistent", "model.path"), ("vlm.entropy_mask_ratio=2", "vlm.entropy_mask_ratio"),
                            ("trainer.n_workers=2", "trainer.n_workers"), ("trainer.mode=one_step_off", "trainer.mode"),
                            ("trainer.strategy=zero3", "trainer.strategy")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            vlm_config(tiny_vlm_path, tmp_path, override)
    # on 3 workers: questions, held-out items and mini-batches must split evenly
    for overrides, field in ((("vlm.val_items=12",), "data.train_batch_size"),
                             (("data.train_batch_size=6", "vlm.val_items=10"), "vlm.val_items"),
                             (("data.train_batch_size=3", "vlm.val_items=9", "actor.ppo_mini_batch_size=4"),
                              "actor.ppo_mini_batch_size")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            vlm_config(tiny_vlm_path, tmp_path, "trainer.backend=ray", "trainer.n_workers=3", *overrides)


@pytest.mark.learning
def test_grpo_raises_the_reward_of_a_random_tiny_vlm(any_tiny_vlm_path, tmp_path):
    """The random model (Qwen2-VL, then Qwen2.5-VL) answers with a word of the answer vocabulary
    a third of the time; the format reward for doing so must climb well above that within 25
    GRPO steps."""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    pattern = "(" + "|".join(shapes_qa.answers()) + ")"
    cfg = vlm_config(any_tiny_vlm_path, tmp_path, "actor.lr=3e-3", "rollout.n=8", "actor.ppo_mini_batch_size=16",
                     "actor.ppo_micro_batch_size=16", "data.train_batch_size=2", "vlm.max_new_tokens=1",
                     f"reward.functions=[{{name: answer_format, options: {{pattern: '{pattern}'}}}}]")
    engine = VLMEngine(cfg)
    items = task_items(cfg, "train", 0, 2)
    rewards = []
    for step in range(1, 26):
        exp, metrics = engine.make_experience(items, step)
        engine.train_on(exp, step)
        rewards.append(metrics["critic/rewards/mean"])
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    record_learning(first, last, None)  # its bar is a level, not a margin: below 0.5, then above 0.8
    assert first < 0.5 and last > 0.8, rewards


def _state(engine):
    out = {f"actor.{i}": p.detach().clone() for i, p in enumerate(engine.trainable)}
    if engine.critic is not None:
        out.update({f"critic.{k}": v.clone() for k, v in engine.critic.state_dict().items()})
    if engine.ema is not None:
        out.update({f"ema.{i}": e.clone() for i, e in enumerate(engine.ema)})
    return out


@pytest.mark.parametrize("extra", [
    ("vlm.estimator=gae", "vlm.freezing_actor_steps=1", "vlm.ema_decay=0.9", "vlm.kl_coef=0.05",
     "vlm.kl_target=0.01", "vlm.kl_horizon=100"),
    ("model.lora_rank=4", "model.lora_alpha=8", "vlm.kl_coef=0.1", "vlm.kl_in_reward=true", "vlm.ptx_coef=0.1"),
    # the running reward moments travel in the checkpoint; each step's refill rounds are its own
    ("model.lora_rank=4", "vlm.dynamic_sampling_rounds=2", "vlm.reward_running_norm=true",
     "vlm.reward_running_norm_minus_mean=true", "vlm.reward_clip=2.0", "vlm.overlong_buffer=2"),
])
def test_four_steps_equal_two_plus_two_bitwise(tiny_vlm_path, tmp_path, extra, monkeypatch, ptx_file):
    """A run killed after its step-2 checkpoint and resumed ends bitwise where an uninterrupted run
    ends, with the config's cosine lr (a schedule over the whole run)."""
    from pixelrl.vlm.trainer import VLMPPOTrainer

    common = ("trainer.total_training_steps=4", "trainer.save_freq=2", "actor.lr=1e-3", "vlm.critic_lr=1e-3",
              *extra, *([f"vlm.ptx_files=[{ptx_file}]"] if "vlm.ptx_coef=0.1" in extra else []))
    whole = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path / "a", *common)).fit()
    assert whole["engine"].cfg.actor.lr_schedule == "cosine"
    vlm_run_killed_after_checkpoint(vlm_config(tiny_vlm_path, tmp_path / "b", *common), monkeypatch, 2)
    resumed = VLMPPOTrainer(vlm_config(tiny_vlm_path, tmp_path / "b", *common)).fit()
    assert len(resumed["history"]) == 2
    a, b = _state(whole["engine"]), _state(resumed["engine"])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    from pixelrl.vlm.engine import VLMEngine

    start = _state(VLMEngine(vlm_config(tiny_vlm_path, tmp_path / "c", *common)))
    assert any(not torch.equal(start[k], a[k]) for k in a if k.startswith("actor"))  # the run trained
    assert whole["engine"].kl_ctl.value == resumed["engine"].kl_ctl.value
    assert whole["history"][-1]["critic/rewards/mean"] == resumed["history"][-1]["critic/rewards/mean"]


def test_shapes_qa_answers_agree_with_the_detector():
    """Answers come from the layout; the independent shapes detector must read the same scene."""
    from pixelrl.shapes.detector import detect

    checked = {"count": 0, "colour": 0, "position": 0}
    for it in shapes_qa.items("test", 0, 90):
        found = detect(it["image"])
        words = it["question"].split()
        if it["type"] == "count":
            colour, shape = words[2], words[3][:-1]
            n = sum(1 for d in found if d.shape == shape and d.colour == colour)
            if n == shapes_qa.COUNT_WORDS.index(it["answer"]):
                checked["count"] += 1
        elif it["type"] == "colour":
            shape = words[4]
            if [d.colour for d in found if d.shape == shape] == [it["answer"]]:
                checked["colour"] += 1
        else:
            s1, s2 = words[2], words[-2]
            a = [d for d in found if d.shape == s1]
            b = [d for d in found if d.shape == s2]
            relation = " ".join(words[3:-3])
            if len(a) == 1 and len(b) == 1:
                holds = {"left of": a[0].cx < b[0].cx, "right of": a[0].cx > b[0].cx,
                         "above": a[0].cy < b[0].cy, "below": a[0].cy > b[0].cy}[relation]
                checked["position"] += holds == (it["answer"] == "yes")
    # the detector misreads a few crowded scenes; the answers must agree with it almost always
    assert all(v >= 27 for v in checked.values()), checked
    answers = [it["answer"] for it in shapes_qa.items("train", 0, 300) if it["type"] == "count"]
    assert set(answers) == set(shapes_qa.COUNT_WORDS)


def test_colour_only_reference_by_hand():
    """The reference policy sees colours, not shapes: a colour question is answered with a random
    object's colour, a count question with the number of objects of the asked colour."""
    scene = [["circle", "red"], ["square", "blue"], ["triangle", "red"]]
    colour_red = {"type": "colour", "question": "what colour is the circle ?", "answer": "red", "objects": scene}
    colour_blue = {**colour_red, "question": "what colour is the square ?", "answer": "blue"}
    count = {"type": "count", "question": "how many red circles are there ?", "objects": scene}
    position = {"type": "position", "question": "is the circle left of the square ?", "answer": "yes", "objects": scene}
    assert shapes_qa.colour_only_accuracy(colour_red) == pytest.approx(2 / 3)  # two of three objects are red
    assert shapes_qa.colour_only_accuracy(colour_blue) == pytest.approx(1 / 3)
    assert shapes_qa.colour_only_accuracy({**count, "answer": "one"}) == 0.0  # it counts both red objects
    assert shapes_qa.colour_only_accuracy({**count, "answer": "two"}) == 1.0
    assert shapes_qa.colour_only_accuracy(position) == 0.5


def test_items_list_the_objects_they_draw():
    from pixelrl.shapes.detector import detect

    for it in shapes_qa.items("test", 0, 30):
        if it["type"] == "count":  # the answer counts the listed objects of the asked kind
            colour, shape = it["question"].split()[2], it["question"].split()[3][:-1]
            assert it["objects"].count([shape, colour]) == shapes_qa.COUNT_WORDS.index(it["answer"])
        elif it["type"] == "colour":  # the asked shape is listed once, in the answer's colour
            shape = it["question"].split()[4]
            assert [c for s, c in it["objects"] if s == shape] == [it["answer"]]
        # every listed object is drawn: the detector finds as many objects, in the listed colours
        assert sorted(d.colour for d in detect(it["image"])) == sorted(c for _, c in it["objects"])


def test_answer_rewards():
    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards import WeightedReward

    reward = WeightedReward.from_functions([{"name": "answer_match"},
                                            {"name": "answer_format", "weight": 0.5, "options": {"pattern": "[a-z]+"}}])
    out = reward(["Red.", "two cats", "yes"], ["q"] * 3, [{"answer": "red"}, {"answer": "two"}, {"answer": "no"}])
    assert out["answer_match"].tolist() == [1.0, 0.0, 0.0]
    assert out["answer_format"].tolist() == [0.0, 0.0, 1.0]
    assert out["overall"].tolist() == [1.0, 0.0, 0.5]
    with pytest.raises(ConfigError, match="pattern"):
        WeightedReward.from_functions([{"name": "answer_format", "options": {"pattern": "("}}])


def test_answer_match_extracts_a_boxed_or_tagged_answer():
    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards import WeightedReward

    responses = [r"<think>2 + 1 = 3, not \boxed{2}</think> so \boxed{3}.", r"\boxed{\frac{1}{2}}", r"\boxed{3",
                 "<answer> Red </answer> <answer>blue</answer>", "blue", "<answer>blue"]
    truth = [{"answer": "3"}, {"answer": r"\frac{1}{2}"}, {"answer": "3"}, {"answer": "blue"}, {"answer": "blue"},
             {"answer": "blue"}]
    boxed = WeightedReward.from_functions([{"name": "answer_match", "options": {"extract": "boxed"}}])
    tag = WeightedReward.from_functions([{"name": "answer_match", "options": {"extract": "tag"}}])
    whole = WeightedReward.from_functions([{"name": "answer_match"}])
    # the last box counts (nested braces kept), an unclosed box or a missing tag is no answer
    assert boxed(responses, ["q"] * 6, truth)["answer_match"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert tag(responses, ["q"] * 6, truth)["answer_match"].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert whole(responses, ["q"] * 6, truth)["answer_match"].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match=r"options\.extract"):
        WeightedReward.from_functions([{"name": "answer_match", "options": {"extract": "last_line"}}])


def test_count_closeness_by_hand():
    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards import WeightedReward

    reward = WeightedReward.from_functions([{"name": "count_closeness", "options": {"scale": 4}}])
    answers = ["three", "3", "Zero.", "four", "red", "two", "ten"]
    truth = ["three", "one", "two", "zero", "two", "red", "7"]
    out = reward(answers, ["q"] * 7, [{"answer": a} for a in truth])
    # 1 - |answered - true| / 4, floored at 0; nothing for a non-number on either side
    assert out["count_closeness"].tolist() == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.25]
    with pytest.raises(ConfigError, match="scale"):
        WeightedReward.from_functions([{"name": "count_closeness", "options": {"scale": 0}}])


def test_console_shows_reward_and_held_out_accuracy(tiny_vlm_path, tmp_path):
    from pixelrl.vlm.trainer import VLMPPOTrainer

    lines = []
    cfg = vlm_config(tiny_vlm_path, tmp_path, "trainer.logger=[console]", "trainer.total_training_steps=1",
                     "trainer.val_before_train=true", "trainer.test_freq=1", "vlm.estimator=gae",
                     "trainer.profile_step=1")
    cfg.trainer.logger = ["console", "jsonl"]
    result = VLMPPOTrainer(cfg, console=lines.append).fit()
    lines = [line for line in lines if not line.startswith("profile of step")]
    assert lines[0].startswith("step 0: ") and "val/accuracy=" in lines[0]
    assert "rewards/mean=" in lines[1] and "explained_variance=" in lines[1] and "val/accuracy=" in lines[1]
    # trainer.profile_step reached the worker: the step's summary, by the worker's two phases
    profile = (Path(result["run_dir"]) / "profile" / "step_1_rank_0.txt").read_text()
    assert profile.startswith("step 1 on cpu") and "experience" in profile and "matmul" in profile
    # per worker: the step's responses and tokens over the time of sampling, scoring and training
    row = result["history"][0]
    seconds = row["timing_s/experience"] + row["timing_s/train"]
    responses = cfg.data.train_batch_size * cfg.rollout.n
    assert row["perf/throughput"] == pytest.approx(responses / seconds)
    assert row["perf/tokens_per_s"] == pytest.approx(row["response/sequence_tokens"] / seconds)
    assert 0 < row["perf/peak_memory_gb"] < 24
    # and `pixelrl plot` draws the run's curves, naming what it drew; an unknown key is one clear error
    from PIL import Image

    from pixelrl.cli import main

    png = tmp_path / "curves.png"
    assert main(["plot", result["run_dir"], "--keys", "val/accuracy*", "critic/explained_variance",
                 "--out", str(png), "--x", "minutes"]) == 0
    assert Image.open(png).size[1] > 4 * 200  # five panels: accuracy, three per type, explained variance
    assert main(["plot", result["run_dir"], "--keys", "nope/*", "--out", str(png)]) == 2


def test_balanced_accuracy_scores_a_one_answer_policy_at_one_over_k_by_hand():
    from pixelrl.vlm.pretrain import summarise_correctness

    # position: "yes" to everything, 3 of 4 questions are yes; colour: red right, blue wrong (twice)
    results = [("position", "yes", 1.0), ("position", "yes", 1.0), ("position", "yes", 1.0), ("position", "no", 0.0),
               ("colour", "red", 1.0), ("colour", "blue", 0.0), ("colour", "blue", 0.0)]
    got = summarise_correctness(results)
    assert got["accuracy"] == pytest.approx(4 / 7)
    assert got["accuracy_position"] == pytest.approx(0.75) and got["accuracy_colour"] == pytest.approx(1 / 3)
    assert got["balanced_accuracy_position"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert got["balanced_accuracy_colour"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert got["balanced_accuracy"] == pytest.approx(0.5)  # the mean over the two types asked
    assert "accuracy_count" not in got and "balanced_accuracy_count" not in got


def test_demo_vlm_prints_the_validated_accuracies_before_and_after(tiny_vlm_path, tmp_path, capsys):
    import json

    from pixelrl.cli import main

    assert main(["demo-vlm", f"model.path={tiny_vlm_path}", f"trainer.default_local_dir={tmp_path}",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
                 "actor.ppo_micro_batch_size=8", "vlm.val_items=12", "trainer.total_training_steps=1",
                 "trainer.test_freq=1", "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
                 "trainer.backend=local", "trainer.n_workers=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    # each step shows, cut to its reward and progress (the demo's console was a no-op)
    assert any(line.startswith("step 1: rewards/mean=") and "[1/1, " in line for line in out)
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out
            if line.split() and line.split()[0] in ("colour", "count", "position", "overall")}
    records = [json.loads(line) for line in (tmp_path / "pixelrl" / "vlm_grpo_shapes_qa" / "metrics.jsonl").open()]
    before, after = [r for r in records if "val/accuracy" in r]
    assert rows["overall"][:4] == pytest.approx([before["val/accuracy"], after["val/accuracy"],
                                                 before["val/balanced_accuracy"], after["val/balanced_accuracy"]],
                                                abs=5e-4)
    assert rows["position"] == pytest.approx([before["val/accuracy_position"], after["val/accuracy_position"],
                                              before["val/balanced_accuracy_position"],
                                              after["val/balanced_accuracy_position"],
                                              0.5], abs=5e-4)
    # the last column: the colour-only reference on the 12 test questions the demo validated on
    items = shapes_qa.items("test", 0, 12)
    colour = [shapes_qa.colour_only_accuracy(it) for it in items if it["type"] == "colour"]
    assert rows["colour"][-1] == pytest.approx(sum(colour) / len(colour), abs=5e-4)
    assert rows["overall"][-1] == pytest.approx(sum(map(shapes_qa.colour_only_accuracy, items)) / 12, abs=5e-4)
    assert any(line.startswith("gain: ") for line in out)
    # its report: the table as an HTML table, the validations by step
    page = (tmp_path / "pixelrl" / "vlm_grpo_shapes_qa" / "report.html").read_text()
    assert f"<td>overall</td><td>{before['val/accuracy']:.3f}</td><td>{after['val/accuracy']:.3f}</td>" in page
    assert "<th>val/accuracy</th>" in page and "No validation was run" not in page


def test_demo_vlm_run_again_goes_beside_the_earlier_run(tiny_vlm_path, tmp_path, capsys):
    """A second demo-vlm (whose before and after must start from scratch) is not refused for the
    first one's checkpoints, nor written over them: it takes the next folder."""
    from pixelrl.cli import main

    earlier = tmp_path / "pixelrl" / "vlm_grpo_shapes_qa"
    (earlier / "checkpoints" / "global_step_1").mkdir(parents=True)
    (earlier / "checkpoints" / "global_step_1" / "kept").write_text("the first run's")
    assert main(["demo-vlm", f"model.path={tiny_vlm_path}", f"trainer.default_local_dir={tmp_path}",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
                 "actor.ppo_micro_batch_size=8", "vlm.val_items=4", "trainer.total_training_steps=1",
                 "trainer.test_freq=1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 "trainer.backend=local", "trainer.n_workers=1"]) == 0
    assert f"an earlier demo-vlm run is in {earlier}: this one writes {earlier}_2" in capsys.readouterr().out
    assert (earlier.parent / "vlm_grpo_shapes_qa_2" / "report.html").is_file()
    assert sorted(p.name for p in earlier.rglob("*")) == ["checkpoints", "global_step_1", "kept"]


@pytest.mark.learning
def test_entropy_bonus_alone_raises_the_policy_entropy(tmp_path):
    """Every answer earns the same reward, so GRPO's advantages are zero and only the entropy
    bonus moves the policy: with vlm.entropy_coef > 0 the entropy of the same responses rises,
    and the logged bonus is their entropy aggregated like the policy loss. (The shipped model:
    a random one is already at maximal entropy.)"""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    def entropy_after_one_step(coef):
        cfg = vlm_config("builtin:shapes_qa_vlm", tmp_path / str(coef), "actor.lr=1e-3", "actor.weight_decay=0",
                         "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=16", f"vlm.entropy_coef={coef}",
                         "reward.functions=[{name: answer_format, options: {pattern: '.*'}}]")
        engine = VLMEngine(cfg)
        exp, metrics = engine.make_experience(task_items(cfg, "train", 0, 4), 1)
        assert metrics["critic/rewards/mean"] == 1.0 and not exp.advantages.any()
        with torch.no_grad():
            before = engine.policy.token_logprobs(exp.batch, with_entropy=True)[1]
        trained = engine.train_on(exp, 1)
        with torch.no_grad():
            after = engine.policy.token_logprobs(exp.batch, with_entropy=True)[1]
        mask = exp.batch.response_mask
        return T.masked_mean(before, mask), T.masked_mean(after, mask), trained, T.aggregate(before, mask)

    before, after, metrics, expected_bonus = entropy_after_one_step(0.5)
    assert_learned(float(before), float(after), 0.01)
    assert metrics["actor/grad_norm"] > 0  # finite: the suppressed tokens' -inf log-probs do not reach it
    assert metrics["actor/entropy_bonus"] == pytest.approx(float(expected_bonus), rel=1e-5)
    before, after, metrics, _ = entropy_after_one_step(0.0)
    assert "actor/entropy_bonus" not in metrics and abs(float(after - before)) < 1e-6


def test_old_log_probs_from_the_sampler_equal_the_recomputed_ones(tiny_vlm_path, tmp_path):
    """vlm.recompute_old_logp=false takes PPO's old log-probs and the entropies from sampling:
    the same numbers as the separate scoring forward (to float reordering), without that forward."""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    def experience(recompute):
        cfg = vlm_config(tiny_vlm_path, tmp_path / str(recompute), f"vlm.recompute_old_logp={recompute}")
        engine = VLMEngine(cfg)
        calls = []
        score = engine.policy.token_logprobs
        engine.policy.token_logprobs = lambda *a, **k: calls.append(1) or score(*a, **k)
        exp, metrics = engine.make_experience(task_items(cfg, "train", 0, 4), 1)
        return exp, metrics, len(calls)

    scored, scored_metrics, scored_calls = experience(True)
    sampled, sampled_metrics, sampled_calls = experience(False)
    assert torch.equal(scored.batch.input_ids, sampled.batch.input_ids)  # the same samples
    assert scored_calls == 4 and sampled_calls == 0  # four micro-batches of 4 against none
    torch.testing.assert_close(sampled.old_logp, scored.old_logp, atol=2e-5, rtol=0)
    assert sampled_metrics["response/entropy"] == pytest.approx(scored_metrics["response/entropy"], abs=2e-5)
    torch.testing.assert_close(sampled.advantages, scored.advantages)


def test_validate_ema_scores_the_ema_actor_and_keeps_the_actor(tmp_path):
    """With an EMA that barely moves (decay 1 - 1e-9), validating the EMA gives the base model's
    answers while the trained actor's differ; afterwards the actor's weights are its own, bitwise."""
    from pixelrl.vlm.worker import VLMWorker

    cfg = vlm_config("builtin:shapes_qa_vlm", tmp_path, "actor.lr=3e-3", "vlm.ema_decay=0.999999999",
                     "vlm.val_items=60", "vlm.validate_ema=false")
    worker = VLMWorker(to_yaml(cfg))
    worker.setup()
    base = worker.validate()
    for step in (1, 2, 3):
        worker.train_step(step)
    trained = [p.detach().clone() for p in worker.engine.trainable]
    actor = worker.validate()
    worker.cfg.vlm.validate_ema = True
    ema = worker.validate()
    assert ema == base and actor != base
    assert all(torch.equal(p, q) for p, q in zip(worker.engine.trainable, trained))
    with pytest.raises(ConfigError, match=r"vlm\.validate_ema"):
        vlm_config("builtin:shapes_qa_vlm", tmp_path, "vlm.ema_decay=0", "vlm.validate_ema=true")


def test_cosine_lr_decays_over_the_actors_optimizer_steps(tiny_vlm_path, tmp_path):
    """4 questions x 4 answers in mini-batches of 8: 2 optimizer steps per step; 5 steps of which
    the first is a critic warm-up leave 8 actor steps, the last one at the floor min_lr_ratio x lr."""
    from pixelrl.vlm.trainer import VLMPPOTrainer

    cfg = vlm_config(tiny_vlm_path, tmp_path, "actor.lr_schedule=cosine", "actor.min_lr_ratio=0.1", "actor.lr=1e-3",
                     "trainer.total_training_steps=5", "vlm.estimator=gae", "vlm.freezing_actor_steps=1")
    result = VLMPPOTrainer(cfg).fit()
    learner = result["engine"].actor_learner
    assert learner.total_steps == 8 and learner.lr_scheduler.last_epoch == 8
    lrs = [row["actor/lr"] for row in result["history"]]  # the lr after each step's optimizer steps
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))
    with pytest.raises(ConfigError, match=r"actor\.lr_schedule"):
        vlm_config(tiny_vlm_path, tmp_path, "actor.lr_schedule=linear")


def test_the_vlm_trainer_keeps_its_best_validation_checkpoint(tiny_vlm_path, tmp_path):
    import json

    from pixelrl.cli import main

    assert main(["train", "--config-name", "vlm_grpo_shapes_qa", f"model.path={tiny_vlm_path}",
                 f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4", "rollout.n=2",
                 "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "vlm.val_items=12",
                 "trainer.total_training_steps=3", "trainer.test_freq=1", "trainer.save_freq=0",
                 "trainer.max_ckpt_to_keep=1", "trainer.best_metric=val/balanced_accuracy", "trainer.logger=[jsonl]",
                 "trainer.backend=local", "trainer.n_workers=1", "trainer.resume_mode=disable"]) == 0
    run = tmp_path / "pixelrl" / "vlm_grpo_shapes_qa"
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    validated = {int(r["step"]): r["val/balanced_accuracy"] for r in records if "val/balanced_accuracy" in r}
    assert sorted(validated) == [0, 1, 2, 3]
    del validated[0]  # the base model has no checkpoint to keep
    best = max(validated, key=validated.get)
    pointer = json.loads((run / "checkpoints" / "best_checkpoint.json").read_text())
    assert (pointer["step"], pointer["value"]) == (best, validated[best])
    assert {p.name for p in (run / "checkpoints").glob("global_step_*")} == {f"global_step_{best}", "global_step_3"}


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_the_adaptive_kl_coefficient_moves_after_the_round_with_lightrfts_kl(tiny_vlm_path, tmp_path, kl_in_reward):
    """LightRFT updates its KL controller after the round's PPO update (with that round's KL and
    response count), so a round's loss uses the coefficient its experience was made under; the
    update is beta *= 1 + clip(KL / target - 1, +-0.2) * n / horizon by hand. The KL it is fed: as a
    loss, the KL the update measured (the mean of its micro-batches' KL terms); in the reward, the
    round's KL per response token (not the mean of the sequences' means)."""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    cfg = vlm_config(tiny_vlm_path, tmp_path, "vlm.kl_coef=0.1", "vlm.kl_target=0.05", "vlm.kl_horizon=100",
                     f"vlm.kl_in_reward={str(kl_in_reward).lower()}")
    engine = VLMEngine(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy some way from its reference (the frozen copy of the start)
        for param in engine.trainable:
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    used, terms = [], []
    exp, metrics = engine.make_experience(task_items(cfg, "train", 0, 4), 1)
    assert engine.kl_ctl.value == metrics["actor/kl_coef"] == 0.1  # not yet moved by this round's KL
    engine.policy.token_logprobs = (lambda score: lambda *a, **k: used.append(engine.kl_ctl.value) or score(*a, **k))(
        engine.policy.token_logprobs)
    estimate = T.kl_estimate
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(T, "kl_estimate", lambda *a: terms.append((estimate(*a), a[2])) or terms[-1][0])
        engine.train_on(exp, 1)
    assert used and set(used) == {0.1}  # every micro-batch of the update trained with the round's coefficient
    if kl_in_reward:
        assert not terms
        kl, mask = estimate(exp.old_logp, exp.ref_logp, exp.batch.response_mask, "k3"), exp.batch.response_mask
        measured = float((kl * mask).sum() / mask.sum())
        assert measured != pytest.approx(metrics["actor/kl"], rel=1e-3)  # lengths differ: not the sequence mean
    else:
        assert len(terms) == 4  # 16 responses in micro-batches of 4
        measured = sum(float(((k.detach() * m).sum(-1) / m.sum(-1)).mean()) for k, m in terms) / len(terms)
        assert measured != pytest.approx(metrics["actor/kl"], rel=1e-3)  # the update moved the policy
    error = min(max(measured / 0.05 - 1, -0.2), 0.2)
    assert engine.kl_ctl.value == pytest.approx(0.1 * (1 + error * 16 / 100), rel=1e-9)


def test_the_vlm_update_reads_no_scalar_back_per_micro_batch(tiny_vlm_path, tmp_path):
    """Actor and critic losses and metrics stay on the device until each optimizer step: eight
    micro-batches read back exactly as many scalars as one."""
    from conftest import ScalarReads

    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    reads = []
    for micro in (2, 16):
        cfg = vlm_config(tiny_vlm_path, tmp_path / str(micro), "rollout.n=8", "actor.ppo_mini_batch_size=16",
                         f"actor.ppo_micro_batch_size={micro}", "data.train_batch_size=2", "vlm.max_new_tokens=2",
                         "vlm.estimator=gae", "vlm.kl_coef=0.05", "vlm.entropy_coef=0.01")
        engine = VLMEngine(cfg)
        exp, _ = engine.make_experience(task_items(cfg, "train", 0, 2), 1)
        with ScalarReads() as counter:
            metrics = engine.train_on(exp, 1)
        assert metrics["actor/grad_norm"] > 0
        reads.append(counter.count)
    assert reads[0] == reads[1]


@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_policy_and_critic_step_float32_weights_and_compute_in_bf16(tiny_vlm_path, tmp_path, lora):
    """vision-language PPO on a bf16 model: the trained weights (the full policy or its LoRA, and
    the critic) are float32, so an AdamW step of 1e-6 moves them where bf16 weights would round
    it away; the forwards compute in bf16; a full fine-tune's frozen reference stays bf16."""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    adapter = ["model.lora_rank=4", "model.lora_alpha=8"] if lora else []
    cfg = vlm_config(tiny_vlm_path, tmp_path, "model.dtype=bfloat16", "actor.lr=1e-6", "vlm.critic_lr=1e-6",
                     "vlm.estimator=gae", "vlm.kl_coef=0.05", "actor.weight_decay=0", *adapter)
    engine = VLMEngine(cfg)
    critic = [p for p in engine.critic.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in [*engine.trainable, *critic])
    if not lora:
        assert all(p.dtype == torch.bfloat16 for p in engine.reference_module.parameters())
    seen = []
    # a projection's output: the residual stream of float32 weights is float32 under autocast too
    projection = engine.policy.model.model.language_model.layers[0].self_attn.q_proj
    hook = projection.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    before = [p.detach().clone() for p in [*engine.trainable, *critic]]
    exp, _ = engine.make_experience(task_items(cfg, "train", 0, 4), 1)
    engine.train_on(exp, 1)
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    moved = [(p != b).float().mean().item() for p, b in zip([*engine.trainable, *critic], before)]
    assert sum(moved) / len(moved) > 0.5, moved


def test_demo_vlm_shows_each_step_with_its_reward_and_progress(capsys):
    """demo-vlm trained silently for minutes: each step's line now shows, cut to its reward and
    progress; other trainer lines pass whole."""
    from pixelrl.cli.vlm import demo_console

    demo_console("step 3: rewards/mean=0.4125  pg_loss=-0.01  grad_norm=0.2  [3/40, 12s, eta 2m05s]")
    demo_console("resumed from runs/x (global step 2)")
    assert capsys.readouterr().out.splitlines() == ["step 3: rewards/mean=0.4125  [3/40, 12s, eta 2m05s]",
                                                   "resumed from runs/x (global step 2)"]
