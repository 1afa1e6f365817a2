"""Start-up validation and dataset errors: one message naming the field (or file and row)."""

import json
import tempfile

import pytest

from pixelrl.config import load_config
from pixelrl.core.errors import ConfigError
from pixelrl.data.prompts import DatasetError, PromptDataset, make_loader, read_prompt_file

from conftest import stand_in_folder, stand_in_safetensors

# validation checks the model folder exists (not what is in it): an empty one stands in
BASE = [f"model.path={stand_in_folder()}"]


def _error(*overrides, config="flow_grpo_tiny"):
    with pytest.raises(ConfigError) as err:
        load_config(config, [*BASE, *overrides])
    return str(err.value)


def test_every_bundled_config_loads_and_validates(tmp_path):
    from conftest import gpu_node_memory

    from pixelrl.core.config_io import CONFIG_DIR

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert len(names) >= 10
    for name in names:
        overrides = BASE if "tiny" in name else []
        with gpu_node_memory():  # the paper configs are for GPU nodes
            for _ in range(4):  # a config for a real checkpoint names folders this machine lacks
                try:
                    load_config(name, overrides)
                    break
                except ConfigError as err:
                    if "options.path" in str(err):  # ... a reward model's folder: a rule reward stands in
                        overrides = [*overrides, "reward.functions=[{name: jpeg_compressibility, weight: 1.0}]"]
                    elif "diffusion_loss.teacher" in str(err):  # ... a teacher LoRA's: a stand-in file
                        (tmp_path / "teacher").mkdir(exist_ok=True)
                        stand_in_safetensors(tmp_path / "teacher" / "pytorch_lora_weights.safetensors")
                        overrides = [*overrides, f"diffusion_loss.teacher={tmp_path / 'teacher'}"]
                    else:  # ... the model's folder
                        assert "`model.path`" in str(err) and "does not exist" in str(err), str(err)
                        overrides = [*overrides, f"model.path={tmp_path}"]
            else:
                raise AssertionError(f"{name} still refused with the stand-ins {overrides}")


def test_bundled_configs_load():
    cfg = load_config("flow_grpo_tiny", BASE)
    assert cfg.rollout.n == 4 and cfg.reward.functions[0]["name"] == "jpeg_compressibility"
    from conftest import gpu_node_memory

    with gpu_node_memory():  # its micro-batches are `auto`: sized for an 80 GB card
        sd35 = load_config("flow_grpo_sd35", BASE)
    assert sd35.rollout.n == 24 and sd35.diffusion_loss.kl_coef == 0.04 and sd35.trainer.strategy == "fsdp2"


def test_config_errors_name_the_field():
    assert "rollout.nn" in _error("rollout.nn=3") and "known keys here" in _error("rollout.nn=3")
    assert "`rollout.n`" in _error("rollout.n=abc")
    message = _error("rollout.n=1")
    assert "`rollout.n` = 1" in message and "rollout.n >= 2" in message
    message = _error("trainer.n_workers=3")
    assert "data.train_batch_size" in message and "16 images" in message and "n_workers = 3" in message
    assert "rollout.sde_type" in _error("rollout.sde_type=euler")
    assert "diffusion_loss.name" in _error("diffusion_loss.name=nope")
    assert "reward.functions[0].name" in _error("reward.functions=[{name: nope}]")
    assert "trainer.logger" in _error("trainer.logger=[console,mlflow]")
    assert "sde_window_size" in _error("rollout.sde_window_size=9")
    assert "--config-name" in _error(config="no_such_config")
    with pytest.raises(ConfigError, match="model.path"):
        load_config("flow_grpo_tiny", ["model.path="])


def test_missing_model_folder_is_reported_by_train(tmp_path, capsys):
    from pixelrl.cli import main

    code = main(["train", "--config-name", "flow_grpo_tiny", f"model.path={tmp_path / 'missing'}",
                 "trainer.backend=local", f"trainer.default_local_dir={tmp_path}"])
    assert code == 2
    assert "does not exist: set model.path" in capsys.readouterr().err


def test_prompt_files_jsonl_parquet_txt(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a cat", "data_source": "pets",
                                                   "metadata": {"count": 1}}) + "\n\n" + json.dumps({"prompt": "a dog"}))
    rows = read_prompt_file(tmp_path / "p.jsonl")
    assert rows == [{"prompt": "a cat", "data_source": "pets", "metadata": {"count": 1}},
                    {"prompt": "a dog", "data_source": "p", "metadata": {}}]
    pq.write_table(pa.table({"text": ["x", "y"], "metadata": ['{"a": 1}', None]}), tmp_path / "q.parquet")
    assert read_prompt_file(tmp_path / "q.parquet", "text")[0]["metadata"] == {"a": 1}
    (tmp_path / "r.txt").write_text("one\n\ntwo\n")
    assert [r["prompt"] for r in read_prompt_file(tmp_path / "r.txt")] == ["one", "two"]


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": ""}', "must be a non-empty string"),
    ('{"text": "a cat"}', "`prompt` must be a non-empty string, got None"),
    ('{"prompt": "a", "metadata": "{oops"}', "not JSON"),
    ('[1, 2]', "expected an object"),
    ('{"prompt": "a cat"', "not valid JSON"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DatasetError, match=f"bad.jsonl, row 2: .*{problem}"):
        read_prompt_file(path)


def test_loader_state_resumes_across_epochs():
    dataset = PromptDataset.from_prompts([f"p{i}" for i in range(7)])
    loader = make_loader(dataset, 3, shuffle=True, seed=1, drop_last=True)
    seen, states = [], []
    for _ in range(3):
        for batch in loader:
            seen.append(batch["prompts"])
            states.append(loader.state_dict())
    resumed = make_loader(dataset, 3, shuffle=True, seed=1, drop_last=True)
    resumed.load_state_dict(states[2])
    again = [b["prompts"] for _ in range(2) for b in resumed]
    assert again == seen[3:]
    assert seen[0] != seen[2]  # each epoch is a new permutation


def test_source_weights_repeat_each_row_of_a_source_in_place():
    """`data.source_weights` as the trainer reads it: rows of a weighted source k times, in place,
    others once, 0 leaves a source out; an epoch of the loader then holds them that many times."""
    from pixelrl.trainers.datasets import datasets_of

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/p.jsonl"
        with open(path, "w") as f:
            for prompt, source in [("a", "one"), ("b", "two"), ("c", "one"), ("d", "three")]:
                f.write(json.dumps({"prompt": prompt, "data_source": source}) + "\n")
        rule = "reward.functions=[{name: jpeg_compressibility, weight: 1.0}]"  # rows without scene metadata
        cfg = load_config("shapes_flow_grpo", [f"data.train_files=[{path}]", "data.source_weights={two: 3, three: 0}",
                                               rule])
        train, _ = datasets_of(cfg)
        assert [r["prompt"] for r in train.rows] == ["a", "b", "b", "b", "c"]
        loader = make_loader(train, 5, shuffle=True, seed=1, drop_last=True)
        assert sorted(next(iter(loader))["prompts"]) == ["a", "b", "b", "b", "c"]
        for weights, problem in [("{four: 2}", "no training row has data_source"), ("{two: 1.5}", "whole number"),
                                 ("{two: -1}", "whole number"), ("{one: 0, two: 0, three: 0}", "leaves no training row")]:
            cfg = load_config("shapes_flow_grpo", [f"data.train_files=[{path}]", f"data.source_weights={weights}", rule])
            with pytest.raises(ConfigError, match=problem):
                datasets_of(cfg)


@pytest.mark.parametrize("override, field", [
    ("model.type=flux9", "model.type"),
    ("model.dtype=float8", "model.dtype"),
    ("model.lora_init=kaiming", "model.lora_init"),
    ("model.lora_rank=-1", "model.lora_rank"),
    ("rollout.logprob_reduction=max", "rollout.logprob_reduction"),
    ("rollout.sigma_schedule=cosine", "rollout.sigma_schedule"),
    ("rollout.sde_window_schedule=mixgrpo_decay", "rollout.sde_window_schedule"),
    ("actor.max_grad_norm=-1", "actor.max_grad_norm"),
    ("diffusion_loss.clip_ratio=0", "diffusion_loss.clip_ratio"),
    ("algorithm.adv_eps=0", "algorithm.adv_eps"),
    ("reward.functions=[{name: jpeg_compresibility}]", "reward.functions[0].name"),
])
def test_each_field_is_validated_at_start_up_naming_itself(override, field):
    assert f"`{field}`" in _error(override)


def test_model_compile_auto_compiles_on_a_cuda_device_only():
    """The paper configs' model.compile=auto: compiled blocks on a GPU, where the compile pays
    for itself (docs/benchmarks.md), eager on a CPU."""
    from pixelrl.config import load_config
    from pixelrl.models.config import ModelConfig

    assert ModelConfig(compile="auto", device="cuda").compiles()
    assert ModelConfig(compile="auto", device="cuda:1").compiles()
    assert not ModelConfig(compile="auto", device="cpu").compiles()
    assert ModelConfig(compile=True, device="cpu").compiles()
    assert not ModelConfig(compile=False, device="cuda").compiles()
    shapes = load_config("shapes_flow_grpo", ["model.compile=auto"])
    assert shapes.model.compile == "auto" and not shapes.model.compiles()


def test_resolution_is_checked_against_the_model_folder_before_any_worker(tiny_sd3_path):
    # VAE scale 2 x patch 2: a multiple of 4
    with pytest.raises(ConfigError, match="rollout.resolution.*multiple of 4"):
        load_config("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "rollout.resolution=30"])
    load_config("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "rollout.resolution=32"])


@pytest.mark.parametrize("override, field", [
    ("actor.lr=inf", "actor.lr"), ("actor.lr=nan", "actor.lr"), ("actor.adam_eps=0", "actor.adam_eps"),
    ("rollout.guidance_scale=nan", "rollout.guidance_scale"), ("val_kwargs.guidance_scale=inf", "val_kwargs.guidance_scale"),
    ("diffusion_loss.clip_ratio=nan", "diffusion_loss.clip_ratio"), ("actor.max_grad_norm=-1", "actor.max_grad_norm"),
])
def test_non_finite_or_out_of_domain_numbers_are_refused_with_their_field(override, field):
    assert f"`{field}`" in _error(override)


def test_an_infinite_clip_means_no_clipping_and_is_accepted():
    assert load_config("flow_grpo_tiny", [*BASE, "actor.max_grad_norm=inf"]).actor.max_grad_norm == float("inf")


@pytest.mark.parametrize("text, expected", [
    ("model:\n  path: x\n rollout: [\n", "not valid YAML at line 3"),
    ("rollout:\n  n: [4\n", "not valid YAML"),
    ("- model\n- rollout\n", "not a mapping"),
])
def test_a_broken_yaml_file_is_named_with_the_line_not_a_traceback(tmp_path, text, expected):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    message = _error(config=str(path))
    assert "--config-name" in message and str(path) in message and expected in message


def test_a_best_metric_must_be_a_validation_metric_of_a_run_that_validates():
    assert "trainer.best_metric" in _error("trainer.best_metric=critic/rewards/mean")
    assert "trainer.test_freq=-1 never validates" in _error("trainer.best_metric=val-core/overall/reward/mean@1",
                                                            "trainer.test_freq=-1")
    assert load_config("flow_grpo_tiny", [*BASE, "trainer.best_metric=val-core/overall/reward/mean@1"])
