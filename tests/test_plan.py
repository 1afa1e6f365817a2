"""`pixelrl plan` and `trainer.fit_to_memory_gb`: the estimate against what was measured, the
FLOP formulas against torch's counter on the real diffusers modules, and the search's choices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import paper_config

from pixelrl.config.plan import Choice, describe, estimate, model_shape, plan_for, step_work
from pixelrl.engine.config import images_per_step, optimizer_steps_per_rollout
from pixelrl.core.errors import ConfigError

# docs/benchmarks.md, "On one NVIDIA H200": (config, overrides, s/step, peak GB, sampling, update + reference).
# The bench ran 2 prompts x 8 images (Wan: 1 x 4), mini-batch 8 (Wan: 2), one-layer text encoders.
BENCH = ["data.train_batch_size=2", "rollout.n=8", "actor.ppo_mini_batch_size=8"]
# The SD3.5 configs' sizes when they were measured (before `auto`): the reference's micro-batch 4
# with checkpointing, 8 images per sampling call; with a mini-batch of 8 the engine runs
# micro-batches of 8, so the tuned setting of 16 means the whole share
WRITTEN = ["actor.ppo_micro_batch_size=4", "model.gradient_checkpointing=true", "rollout.micro_batch_size=8"]
TUNED = ["actor.ppo_micro_batch_size=16", "model.gradient_checkpointing=false", "rollout.micro_batch_size=8"]
FAST64 = ["data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=64", "rollout.micro_batch_size=32",
          "model.gradient_checkpointing=false"]
WAN = ["data.train_batch_size=1", "rollout.n=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
       "rollout.micro_batch_size=2", "model.gradient_checkpointing=true"]
MEASURED = {
    "sd35": ("flow_grpo_sd35", WRITTEN, 27.0, 10.2),
    "sd35_tuned": ("flow_grpo_sd35", TUNED, 12.9, 38.8),
    "sd35_fast": ("flow_grpo_fast_sd35", WRITTEN, 8.5, 10.2),
    "sd35_fast_tuned": ("flow_grpo_fast_sd35", TUNED, 3.8, 22.3),
    "awm_sd35": ("awm_sd35", TUNED, 8.8, 22.5),
    "wan": ("dance_grpo_wan", WAN, 56.3, 11.2),
    # 8 prompts x 8 images in one optimizer step: the update at 16 and 32 samples per call
    "fast64_micro16": ("flow_grpo_fast_sd35", FAST64 + ["actor.ppo_micro_batch_size=16"], 11.42, 38.7),
    "fast64_micro32": ("flow_grpo_fast_sd35", FAST64 + ["actor.ppo_micro_batch_size=32"], 11.38, 71.6),
}
ONE_LAYER_ENCODERS = {"sd3": 0.223e9, "wan": 0.193e9}  # the benchmark folders' text encoders


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_the_estimate_reproduces_the_measured_gpu_steps(case):
    """Step time within 10% and peak memory within 3% of each measured H200 case (the time constants
    are a least-squares fit over these eight steps; the activation bytes were fitted on
    fast64_micro32 and the decode bytes on the checkpointed cases, the others check them)."""
    name, overrides, seconds, peak = MEASURED[case]
    # measured eager (the recipes' model.compile is auto: compiled on a GPU)
    cfg = paper_config(name, *BENCH, *overrides, "trainer.n_workers=1", "trainer.strategy=fsdp2", "model.compile=false")
    shape = dataclasses.replace(model_shape(cfg), encoder_params=ONE_LAYER_ENCODERS[cfg.model.type])
    choice = Choice(cfg.actor.ppo_micro_batch_size, cfg.model.gradient_checkpointing, cfg.rollout.micro_batch_size)
    est = estimate(cfg, shape, step_work(cfg, 1), 1, choice, 989.0)
    assert est.step_s == pytest.approx(seconds, rel=0.10)
    assert est.peak_gb == pytest.approx(peak, rel=0.03)


def test_compiled_blocks_shorten_the_denoisers_time_as_measured():
    """The recipes' model.compile=auto compiles on a GPU, and the estimate says so: the tuned
    Flow-GRPO step with compiled blocks measured 7.26 s on the H200 (docs/benchmarks.md), with its
    memory unchanged and the decode's time not compiled."""
    def tuned(compile_setting):
        cfg = paper_config("flow_grpo_sd35", *BENCH, *TUNED, "trainer.n_workers=1", compile_setting)
        shape = dataclasses.replace(model_shape(cfg), encoder_params=ONE_LAYER_ENCODERS["sd3"])
        return cfg, estimate(cfg, shape, step_work(cfg, 1), 1, Choice(16, False, 8), 989.0)

    cfg, compiled = tuned("model.compile=auto")
    assert cfg.model.device == "cuda" and cfg.model.compiles()
    _, eager = tuned("model.compile=false")
    assert compiled.step_s == pytest.approx(7.26, rel=0.05)
    assert compiled.peak_gb == eager.peak_gb and compiled.step_flops == eager.step_flops
    assert compiled.no_grad_s / eager.no_grad_s == pytest.approx(0.56)
    assert compiled.sampling_s / eager.sampling_s > 0.56  # the decode stays eager
    for setting, says in (("model.compile=auto", True), ("model.compile=false", False)):  # the plan says which
        cfg = paper_config("flow_grpo_sd35", setting)
        assert ("compiled blocks" in describe(cfg, plan_for(cfg, 2, 80))) == says


def test_the_tuned_flow_grpo_step_costs_what_the_flop_meter_counted():
    """The bench's FLOP meter counted 3.30 PFLOP for the tuned SD3.5 step (MFU 0.258 x 989 TFLOP/s
    x 12.9 s); the estimate's FLOPs are the same forwards and backwards, counted by formula."""
    cfg = paper_config("flow_grpo_sd35", *BENCH, *TUNED, "trainer.n_workers=1")
    choice = Choice(16, False, 8)
    est = estimate(cfg, model_shape(cfg), step_work(cfg, 1), 1, choice, 989.0)
    assert est.step_flops / 1e15 == pytest.approx(3.30, rel=0.02)


def _counted_flops(module, *args, **kwargs) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from pixelrl.engine.flops import EXTRA_FLOP_FORMULAS

    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        module(*args, **kwargs)
    return counter.get_total_flops()


def test_forward_flops_match_torchs_counter_on_each_family():
    """The per-row forward FLOPs of the four families' formulas (each `FamilySpec.cost`) against
    torch's FLOP counter on the diffusers modules at width 256: within 4%, the remainder being
    what the formulas leave out on purpose (per-sample modulation, embedders, the output layer)."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    from pixelrl.models.family import RowInput
    from pixelrl.models.loader import family_spec

    def _denoiser_flops(family, cfg, res, frames, text):
        return family_spec(family).cost(cfg, RowInput(res, res, frames, text)).forward_flops

    torch.manual_seed(0)
    heads, head_dim, text, res = 4, 64, 24, 256  # d = 256; 256 px = 16 x 16 packed latent tokens... per family
    sd3_cfg = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=head_dim,
                   num_attention_heads=heads, joint_attention_dim=64, caption_projection_dim=heads * head_dim,
                   pooled_projection_dim=32, pos_embed_max_size=32, dual_attention_layers=(0,))
    sd3 = SD3Transformer2DModel(**sd3_cfg)
    counted = _counted_flops(sd3, hidden_states=torch.randn(1, 16, 32, 32), encoder_hidden_states=torch.randn(1, text, 64),
                             pooled_projections=torch.randn(1, 32), timestep=torch.tensor([500.0]))
    assert _denoiser_flops("sd3", sd3_cfg, res, 1, text) == pytest.approx(counted, rel=0.04)

    flux_cfg = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=head_dim,
                    num_attention_heads=heads, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=False,
                    axes_dims_rope=(16, 24, 24))
    flux = FluxTransformer2DModel(**flux_cfg)
    image = (res // 16) ** 2
    counted = _counted_flops(flux, hidden_states=torch.randn(1, image, 64), encoder_hidden_states=torch.randn(1, text, 64),
                             pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                             img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3))
    assert _denoiser_flops("flux", flux_cfg, res, 1, text) == pytest.approx(counted, rel=0.04)

    qwen_cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=head_dim,
                    num_attention_heads=heads, joint_attention_dim=64, axes_dims_rope=(16, 24, 24))
    qwen = QwenImageTransformer2DModel(**qwen_cfg)
    side = res // 16
    counted = _counted_flops(qwen, hidden_states=torch.randn(1, image, 64), encoder_hidden_states=torch.randn(1, text, 64),
                             encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.long), timestep=torch.tensor([0.5]),
                             img_shapes=[[(1, side, side)]])
    assert _denoiser_flops("qwen_image", qwen_cfg, res, 1, text) == pytest.approx(counted, rel=0.04)

    wan_cfg = dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                   out_channels=16, text_dim=64, freq_dim=32, ffn_dim=1024, num_layers=2, rope_max_seq_len=64)
    wan = WanTransformer3DModel(**wan_cfg)
    frames = 5  # two latent frames
    counted = _counted_flops(wan, hidden_states=torch.randn(1, 16, 2, res // 8, res // 8),
                             encoder_hidden_states=torch.randn(1, text, 64), timestep=torch.tensor([500]))
    assert _denoiser_flops("wan", wan_cfg, res, frames, text) == pytest.approx(counted, rel=0.04)


def test_a_folder_here_is_measured_from_its_own_files(tiny_sd3_path):
    """With the model folder present the shape comes from its config.json and the parameters
    stored in its safetensors files, not from a published release."""
    from safetensors.torch import load_file

    cfg = paper_config("flow_grpo_sd35")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(tiny_sd3_path), max_sequence_length=0))
    shape = model_shape(cfg)
    stored = sum(t.numel() for f in (tiny_sd3_path / "transformer").glob("*.safetensors") for t in load_file(f).values())
    assert shape.denoiser_params == stored and shape.name == str(tiny_sd3_path)
    assert shape.denoiser_params < 1e7  # not SD3.5-Medium's 2.47B


def test_a_family_is_planned_by_its_own_spec_and_an_unknown_one_is_refused(monkeypatch):
    """`model_shape` takes the tokens, FLOPs and release of `model.type` from that family's
    FamilySpec (a plugin's family is planned by its own formula, not FLUX's), and a type no spec
    stands for is one error naming model.type."""
    from pixelrl.models.family import DenoiserCost
    from pixelrl.models.loader import MODEL_TYPES, family_spec

    cfg = paper_config("flow_grpo_sd35")
    sd3 = family_spec("sd3")
    seen = []

    def own_cost(config, row):
        seen.append(row)
        return DenoiserCost(3, 7, 11, 13.0, 17)

    mine = dataclasses.replace(sd3, name="my_family", cost=own_cost, text_tokens=lambda max_sequence_length: 5)
    monkeypatch.setitem(MODEL_TYPES._entries, "my_family", lambda: mine)
    shape = model_shape(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, type="my_family")))
    assert (shape.layers, shape.hidden, shape.seq_tokens, shape.forward_flops, shape.latent_values) == (3, 7, 11, 13.0, 17)
    assert seen[0].text_tokens == 5 and seen[0].height == seen[0].width == cfg.rollout.resolution
    with pytest.raises(ConfigError, match="model.type"):
        model_shape(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, type="unheard_of")))


def test_an_edit_family_plans_its_condition_tokens():
    """FLUX.1 Kontext's rows carry the source's tokens in the sequence: one image's worth more
    than FLUX.1's at the same size, with more FLOPs and the same stored latents."""
    cfg = paper_config("flow_grpo_flux")
    kontext = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, type="flux_kontext"))
    flux, edit = model_shape(cfg), model_shape(kontext)
    assert edit.seq_tokens == flux.seq_tokens + (cfg.rollout.resolution // 16) ** 2
    assert edit.forward_flops > 1.5 * flux.forward_flops and edit.latent_values == flux.latent_values
    assert "Kontext" in edit.name


def test_the_plan_counts_the_pictures_the_training_rows_give(tmp_path):
    """Qwen-Image-Edit-Plus rows with two pictures carry two sources' tokens in each row's
    sequence: the plan reads the count from data.train_files when the file is here (one picture,
    the family's own, when it is not), without opening the pictures (it runs at every config
    load; loading the rows to train checks them: here b.png is no image at all)."""
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 40, 40)).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"not an image")
    rows = tmp_path / "edits.jsonl"
    rows.write_text('{"prompt": "put the cat on the chair", "images": ["a.png", "b.png"]}\n' * 3)
    one = model_shape(paper_config("flow_grpo_qwen_image_edit"))
    two = model_shape(paper_config("flow_grpo_qwen_image_edit", f"data.train_files=[{rows}]"))
    side = paper_config("flow_grpo_qwen_image_edit").rollout.condition_resolution // 16  # 1024 px: 4096 tokens
    assert two.seq_tokens == one.seq_tokens + side ** 2 and two.forward_flops > one.forward_flops
    assert "2 condition pictures a row" in two.name and "pictures" not in one.name


def test_the_plan_keeps_the_algorithm_and_fits_the_memory():
    cfg = paper_config("flow_grpo_sd35")
    for gpus, memory in ((1, 80), (2, 80), (8, 80), (8, 40)):
        plan = plan_for(cfg, gpus, memory)
        planned = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, n_workers=gpus))
        assert images_per_step(planned) == images_per_step(cfg) == 1152
        assert optimizer_steps_per_rollout(planned) == optimizer_steps_per_rollout(cfg) == 2
        assert plan.estimate.peak_gb <= 0.9 * memory
        assert (576 // gpus) % plan.choice.micro_batch == 0  # equal micro-batches on every worker (FSDP2)
        assert not any(name.startswith(("data.", "diffusion_loss.", "rollout.n=", "actor.ppo_mini"))
                       for name in plan.overrides)
    # less memory: a smaller update (micro-batch or checkpointing), never a larger estimated peak
    roomy, tight = plan_for(cfg, 8, 80), plan_for(cfg, 8, 24)
    assert tight.estimate.peak_gb < roomy.estimate.peak_gb <= 72
    assert (tight.choice.micro_batch, tight.choice.checkpointing) != (roomy.choice.micro_batch, roomy.choice.checkpointing)
    assert tight.estimate.step_s > roomy.estimate.step_s


def test_a_plan_for_a_method_that_samples_nothing_keeps_its_sampling_micro_batch():
    """SFT samples only for validation: the plan sizes its update and leaves rollout.micro_batch_size
    as written (it proposed 1, from a step that samples no image)."""
    from pixelrl.config import load_config

    cfg = load_config("shapes_sft", ["data.train_files=[no_such_folder/demonstrations.jsonl]"])
    plan = plan_for(cfg, 1, 80)
    assert plan.choice.sampling_micro_batch == cfg.rollout.micro_batch_size == 64
    assert "rollout.micro_batch_size" not in describe(cfg, plan, "shapes_sft")


def test_the_plan_refuses_what_cannot_work():
    cfg = paper_config("flow_grpo_sd35")
    with pytest.raises(ConfigError, match=r"`--gpus` = 7.*GPU counts that keep the recipe: \[1, 2, 3, 4, 6"):
        plan_for(cfg, 7, 80)
    with pytest.raises(ConfigError, match=r"`--gpu-memory` = 12.*needs about \d+ GB per GPU"):
        plan_for(cfg, 1, 12)  # the text encoders and the denoiser alone take 16 GB


def test_describe_prints_the_command_and_what_changed():
    cfg = paper_config("flow_grpo_sd35")
    text = describe(cfg, plan_for(cfg, 2, 80), "flow_grpo_sd35")
    assert "1152 images per step, 576 per optimizer step, 2 optimizer step(s) per rollout batch" in text
    assert "trainer.n_workers: 8 -> 2" in text
    assert text.splitlines()[-1].startswith("run: pixelrl train --config-name flow_grpo_sd35 trainer.n_workers=2 ")
    assert "flow_grpo (clip 0.0001, KL 0.04)" in text
    # a forward-process loss reads none of the transition fields: the plan names its own params
    awm = paper_config("awm_sd35")
    text = describe(awm, plan_for(awm, 8, 80), "awm_sd35")
    assert "awm (" in text and "clip 0.0001" not in text and "beta_ref 0.001" in text


def test_pixelrl_plan_on_a_paper_config_names_the_missing_folder(capsys):
    from pixelrl.cli import main

    assert main(["plan", "--config-name", "dance_grpo_wan", "--gpus", "1", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "Wan2.1-T2V-1.3B (published shape)" in out
    assert "not checked on this machine: config field `model.path`" in out


def test_a_plan_names_every_missing_path_at_once(capsys):
    """The edit recipe's reward model, model folder and data files are all elsewhere: each is
    named on its own line (a stand-in takes each one's place so the checks after it still run),
    where the plan used to stop at the first."""
    from pixelrl.cli import main

    assert main(["plan", "--config-name", "flow_grpo_qwen_image_edit", "--gpus", "8", "--gpu-memory", "80"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not checked on this machine")]
    named = " ".join(notes)
    assert len(notes) == 4
    for field in ("reward.functions[0].options.path", "model.path", "data.train_files", "data.val_files"):
        assert f"`{field}`" in named
    assert "/models/Qwen-Image-Edit-2511" in named and "data/edit/train.jsonl" in named


def test_fit_to_memory_gb_chooses_the_micro_batches_at_start_up(tmp_path, tiny_sd3_path, capsys):
    from pixelrl.config import load_config

    base = [f"model.path={tiny_sd3_path}", "trainer.backend=local", "model.max_sequence_length=0",
            "rollout.resolution=32", f"trainer.default_local_dir={tmp_path}", "actor.ppo_micro_batch_size=1"]
    as_written = load_config("flow_grpo_tiny", base)
    fitted = load_config("flow_grpo_tiny", [*base, "trainer.fit_to_memory_gb=80"])
    assert as_written.actor.ppo_micro_batch_size == 1
    assert fitted.actor.ppo_micro_batch_size == images_per_step(fitted)  # a tiny model fits the whole batch
    assert "sized for 80.0 GB per worker (trainer.fit_to_memory_gb): actor.ppo_micro_batch_size=" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="trainer.fit_to_memory_gb"):
        load_config("flow_grpo_tiny", [*base, "trainer.fit_to_memory_gb=-1"])


AUTO_SD35 = [*BENCH, "trainer.n_workers=1"]  # flow_grpo_sd35 ships its three sizes as `auto`


@pytest.mark.parametrize("memory_gb", [20, 24, 30, 40, 80, 141])
def test_auto_picks_the_fastest_sizes_that_fit_and_checkpoints_only_when_it_pays(memory_gb):
    """Against each budget: the chosen sizes fit it (with the headroom), no larger update
    micro-batch or sampling call fits beside them, and checkpointing is on only when no update
    micro-batch fits without it or every one that does is slower (tiny micro-batches)."""
    from pixelrl.config.plan import HEADROOM, NEAR_TIE

    cfg = paper_config("flow_grpo_sd35", *AUTO_SD35, f"trainer.fit_to_memory_gb={memory_gb}")
    a, m, r = cfg.actor, cfg.model, cfg.rollout
    assert all(isinstance(v, int) for v in (a.ppo_micro_batch_size, r.micro_batch_size))
    shape, work, budget = model_shape(cfg), step_work(cfg, 1), memory_gb * HEADROOM

    def peak(micro, checkpointing, sampling):
        return estimate(cfg, shape, work, 1, Choice(micro, checkpointing, sampling), 989.0)

    chosen = peak(a.ppo_micro_batch_size, m.gradient_checkpointing, r.micro_batch_size)
    assert chosen.peak_gb <= budget
    share = 8  # a mini-batch of 8 on one worker
    bigger = [d for d in range(a.ppo_micro_batch_size + 1, share + 1) if share % d == 0]
    if bigger and not m.gradient_checkpointing:  # a larger micro-batch without recompute must not fit
        assert chosen.step_s <= peak(bigger[0], False, r.micro_batch_size).step_s or \
            peak(bigger[0], False, r.micro_batch_size).peak_gb > budget
    without = [e for e in (peak(d, False, s) for d in (1, 2, 4, 8) for s in (1, 2, 4, 8, 16)) if e.peak_gb <= budget]
    if m.gradient_checkpointing:
        assert all(e.step_s > chosen.step_s * (1 + NEAR_TIE) for e in without)
    assert m.gradient_checkpointing is (memory_gb < 40)  # 80 and 141 GB fit the whole share without it
    assert r.micro_batch_size == 16 or peak(a.ppo_micro_batch_size, m.gradient_checkpointing, 2 * r.micro_batch_size
                                            ).sampling_gb + chosen.resident_gb > budget


def test_auto_sizes_change_only_the_fields_written_auto(capsys):
    """A size written as a number stays; the others are chosen around it, and the strategy is the
    config's."""
    cfg = paper_config("flow_grpo_sd35", *AUTO_SD35, "rollout.micro_batch_size=2", "trainer.fit_to_memory_gb=80")
    assert cfg.rollout.micro_batch_size == 2 and cfg.actor.ppo_micro_batch_size == 8
    assert cfg.model.gradient_checkpointing is False and cfg.trainer.strategy == "fsdp2"
    err = capsys.readouterr().err
    assert "rollout.micro_batch_size" not in err and "actor.ppo_micro_batch_size=8" in err
    # with nothing `auto`, trainer.fit_to_memory_gb chooses every size (a recipe for other cards)
    written = paper_config("flow_grpo_sd35", *AUTO_SD35, *WRITTEN, "trainer.fit_to_memory_gb=80")
    assert (written.actor.ppo_micro_batch_size, written.model.gradient_checkpointing) == (8, False)
    # too little memory for the size written names the sizes that could be `auto`
    with pytest.raises(ConfigError, match="or auto for rollout.micro_batch_size"):
        paper_config("flow_grpo_sd35", *AUTO_SD35, "rollout.micro_batch_size=48", "trainer.fit_to_memory_gb=24")


def test_auto_reads_the_gpus_memory_or_says_how_to_give_it(capsys, monkeypatch, tmp_path):
    """`model.device=cuda`: the card's total memory as torch reports it, the same plan as
    trainer.fit_to_memory_gb of that many GB; no visible GPU names trainer.fit_to_memory_gb."""
    from types import SimpleNamespace

    from pixelrl.config import load_config

    folder = f"model.path={tmp_path}"
    # the workers are on a cluster's other nodes (a cluster started here has only this machine's GPUs)
    with pytest.raises(ConfigError, match="trainer.fit_to_memory_gb to each GPU's memory") as err:
        load_config("flow_grpo_sd35", [folder, *AUTO_SD35, "trainer.ray_address=10.0.0.1:6379"])
    assert "`actor.ppo_micro_batch_size` = 'auto'" in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
        total_memory=40e9, name="Stand-in GPU"))
    cfg = load_config("flow_grpo_sd35", [folder, *AUTO_SD35])
    assert "sized for 40.0 GB per worker (Stand-in GPU's memory)" in capsys.readouterr().err
    given = paper_config("flow_grpo_sd35", *AUTO_SD35, "trainer.fit_to_memory_gb=40")
    assert (cfg.actor.ppo_micro_batch_size, cfg.model.gradient_checkpointing, cfg.rollout.micro_batch_size) == \
        (given.actor.ppo_micro_batch_size, given.model.gradient_checkpointing, given.rollout.micro_batch_size)


def test_auto_on_a_cpu_sizes_against_this_machines_ram(tmp_path, tiny_sd3_path, capsys):
    from pixelrl.config import load_config

    cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_sd3_path}", "model.max_sequence_length=0",
                                         "rollout.resolution=32", f"trainer.default_local_dir={tmp_path}",
                                         "actor.ppo_micro_batch_size=auto", "rollout.micro_batch_size=auto"])
    assert cfg.actor.ppo_micro_batch_size == images_per_step(cfg) // cfg.trainer.n_workers  # a tiny model: all
    assert cfg.rollout.micro_batch_size == images_per_step(cfg) // cfg.trainer.n_workers
    assert f"this machine's RAM over {cfg.trainer.n_workers} worker(s)" in capsys.readouterr().err


def test_a_step_larger_than_this_machine_is_refused_with_its_numbers(tmp_path, tiny_pixel_path, monkeypatch):
    """Pixels and stored trajectories by hand: the tiny pixel-space SD3 at 32 px keeps 3 x 32 x 32
    = 3072 float32 values per latent; a 4-step transition run stores the window's 3 + 1 latents and
    the final one (5), beside 3072 bytes of pixels: 3072 + 5 x 3072 x 4 = 64,512 bytes per image."""
    import psutil

    from pixelrl.config import load_config, step_size

    args = [f"model.path={tiny_pixel_path}", "model.max_sequence_length=0", "rollout.resolution=32",
            "rollout.num_steps=4", "data.train_batch_size=2", "rollout.n=4", "trainer.backend=local",
            f"trainer.default_local_dir={tmp_path}"]
    total = psutil.virtual_memory()._replace
    monkeypatch.setattr(psutil, "virtual_memory", lambda: total(total=8 * 64_512))
    load_config("flow_grpo_tiny", args)  # exactly fits
    monkeypatch.setattr(psutil, "virtual_memory", lambda: total(total=8 * 64_512 - 1))
    with pytest.raises(ConfigError, match="`rollout.n` = 4: a step samples data.train_batch_size x rollout.n = 8 images"):
        load_config("flow_grpo_tiny", args)
    monkeypatch.undo()
    # time: the step's FLOPs at this machine's rate must stay under a day
    monkeypatch.setattr(step_size, "_this_machines_rate", lambda cfg: (1e3, "a stand-in rate"))
    with pytest.raises(ConfigError, match=r"at least \d+ hours per step on each of trainer.n_workers=1 at a stand-in"):
        load_config("flow_grpo_tiny", args)


def test_communication_per_step_by_hand_and_the_strategy_it_picks():
    """Flow-GRPO SD3.5 on 8 GPUs, micro-batch 24, sampling 24: each worker makes 6 x 10 sampling
    calls, 6 x 9 reference calls and 6 x 9 training calls. FSDP2 all-gathers the 2.47B bf16
    denoiser (4.94 GB) per forward and again per backward ((60 + 54) + 2 x 54 = 222 gathers) and
    reduce-scatters the LoRA gradients (r32 x 2 x 1536 x 8 projections x 24 layers = 18.87M
    float32) per backward; DDP all-reduces those gradients once per optimizer step (2). A ring
    moves 7/8 of each buffer."""
    cfg = paper_config("flow_grpo_sd35")
    shape = model_shape(cfg)
    work = step_work(cfg, 8)
    lora = 32 * 2 * 1536 * 8 * 24 * 4
    fsdp = estimate(cfg, shape, work, 8, Choice(24, False, 24, "fsdp2"), 989.0)
    assert fsdp.communication_gb * 1e9 == pytest.approx(7 / 8 * (222 * 2.47e9 * 2 + 54 * lora), rel=1e-9)
    ddp_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, strategy="ddp"))
    ddp = estimate(ddp_cfg, shape, work, 8, Choice(24, False, 24, "ddp"), 989.0)
    assert ddp.communication_gb * 1e9 == pytest.approx(7 / 8 * 2 * lora * 2, rel=1e-9)
    assert estimate(cfg, shape, step_work(cfg, 1), 1, Choice(24, False, 24), 989.0).communication_gb == 0
    # FLUX's 24 GB of weights: within a node FSDP2's gathers cost less than DDP's smaller
    # micro-batches, so the recipe's fsdp2 stays; over InfiniBand they do not, and DDP is chosen
    flux = paper_config("flow_grpo_flux")
    assert plan_for(flux, 8, 80).choice.strategy == "fsdp2"
    across = plan_for(flux, 8, 80, link_gb_per_s=45)
    assert across.choice.strategy == "ddp" and "trainer.strategy=ddp" in across.overrides


def test_the_estimate_logged_beside_the_measured_peak_is_the_one_auto_chose_by(capsys):
    """On a GPU the trainer logs perf/estimated_peak_memory_gb beside perf/peak_memory_gb: the
    plan's estimate for the sizes the run uses, the number the start-up line printed."""
    from pixelrl.config.auto_size import estimated_peak_gb

    cfg = paper_config("flow_grpo_sd35", *AUTO_SD35, "trainer.fit_to_memory_gb=80")
    assert f"(estimated peak {estimated_peak_gb(cfg):.1f} GB," in capsys.readouterr().err
    two = paper_config("flow_grpo_sd35", *BENCH, "trainer.n_workers=2", "trainer.fit_to_memory_gb=80")
    assert f"(estimated peak {estimated_peak_gb(two):.1f} GB," in capsys.readouterr().err


def test_a_full_fine_tune_holds_its_frozen_reference_copy_whole_on_every_gpu():
    """Full fine-tuning keeps a frozen copy of the denoiser for the KL term, taken before FSDP2
    shards anything: 2.47B bf16 parameters (4.94 GB) on each GPU beside the sharded float32
    state; without the KL term, none."""
    from pixelrl.config.plan import resident_bytes

    def resident(kl: float, gpus: int) -> float:
        cfg = paper_config("flow_grpo_sd35", "model.lora_rank=0", f"diffusion_loss.kl_coef={kl}")
        return resident_bytes(cfg, model_shape(cfg), gpus)

    params = model_shape(paper_config("flow_grpo_sd35")).denoiser_params
    assert resident(0.04, 4) - resident(0.0, 4) == pytest.approx(params * 2, rel=1e-9)
    # what FSDP2 does shard: float32 weights, gradients, Adam's moments and the recipe's EMA
    assert resident(0.0, 1) - resident(0.0, 4) == pytest.approx(params * (16 + 4) * 3 / 4, rel=1e-9)


def test_auto_leaves_room_for_reward_models_on_the_same_card(tmp_path, capsys, monkeypatch):
    """One process (trainer.backend=local) sizes against what the card has free (40 of 48 GB:
    another job holds 8) and scores its rewards on the policy's GPU: a reward folder holding 6 GB
    of safetensors leaves the sizes 40 - 6 = 34 GB, the plan of trainer.fit_to_memory_gb=34. A Ray
    driver reads the card's total (a CUDA context there would sit on a worker's GPU), and its
    reward workers are elsewhere: the whole 48 GB."""
    from types import SimpleNamespace

    from pixelrl.config import auto_size, load_config

    reward = tmp_path / "reward_model"
    reward.mkdir()
    with open(reward / "model.safetensors", "wb") as f:
        f.truncate(6 * 10 ** 9)  # sparse: the size is what counts
    (tmp_path / "model").mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
        total_memory=48e9, name="Stand-in GPU"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (40e9, 48e9))
    loaded = load_config("flow_grpo_sd35", [f"model.path={tmp_path / 'model'}", "trainer.backend=local",
                                            "trainer.n_workers=1", *AUTO_SD35])
    assert auto_size.reward_models_gb(loaded) == 0.0  # its reward names no folder

    def unsized(backend: str, fit: float = 0.0):
        """The loaded config with its sizes `auto` again and a reward model in `reward`."""
        return dataclasses.replace(
            loaded, trainer=dataclasses.replace(loaded.trainer, backend=backend, fit_to_memory_gb=fit),
            actor=dataclasses.replace(loaded.actor, ppo_micro_batch_size="auto"),
            model=dataclasses.replace(loaded.model, gradient_checkpointing="auto"),
            rollout=dataclasses.replace(loaded.rollout, micro_batch_size="auto"),
            reward=dataclasses.replace(loaded.reward, functions=[
                {"name": "pickscore", "weight": 1.0, "options": {"path": str(reward)}}]))

    sizes = lambda c: (c.actor.ppo_micro_batch_size, c.model.gradient_checkpointing,  # noqa: E731
                       c.rollout.micro_batch_size)
    capsys.readouterr()
    local = auto_size.fit_to_memory(unsized("local"))
    assert "sized for 34.0 GB per worker (Stand-in GPU's free memory, 40.0 of 48.0 GB, less 6.0 GB of reward models" \
        in capsys.readouterr().err
    assert sizes(local) == sizes(auto_size.fit_to_memory(unsized("ray", fit=34.0)))
    assert auto_size.reward_models_gb(unsized("ray")) == 0.0
    assert sizes(local) != sizes(auto_size.fit_to_memory(unsized("ray")))  # the whole 48 GB fits more
    assert "sized for 48.0 GB per worker (Stand-in GPU's memory)" in capsys.readouterr().err


def test_a_dmd2_plan_counts_the_second_adapter_and_every_forward_of_its_cycle():
    """dmd2_sd35 on 8 GPUs: a step is 6 attempts of 64 images per GPU, each one optimizer step and
    one forward with gradient per image; without gradient, 1.5 student steps before the exit on
    average, then the student's exit forward (fake attempts) or the guided teacher's two branches
    and the fake score (student attempts). The weights and state hold two adapters' worth."""
    from pixelrl.config.plan import TRAINABLE_STATE_BYTES, lora_parameters, resident_bytes

    cfg = paper_config("dmd2_sd35", "trainer.strategy=ddp")
    work = step_work(cfg, 8)
    assert (work.trained_samples, work.substeps, work.optimizer_steps, work.sampled_images) == (64 * 6, 1, 6, 0)
    assert work.no_grad_passes == pytest.approx((5 * (1.5 + 1) + (1.5 + 3)) / 6)
    shape = model_shape(cfg)
    one_adapter = dataclasses.replace(cfg, diffusion_loss=dataclasses.replace(cfg.diffusion_loss, name="flow_grpo",
                                                                              params={}))
    extra = resident_bytes(cfg, shape, 8) - resident_bytes(one_adapter, shape, 8)
    assert extra == pytest.approx(lora_parameters(cfg, shape) * TRAINABLE_STATE_BYTES)
    text = describe(cfg, plan_for(cfg, 8, 80.0), "dmd2_sd35")
    assert "512 images per attempt" in text and "6 attempts per step" in text and "no-grad forwards" in text


def test_the_plan_reads_as_a_user_adds_it_up():
    """The peak is weights + the larger of update and sampling (said so); the step time includes
    the communication the planner counted; videos are videos; the run's total, and a warning for an
    hour-long step."""
    import re

    cfg = paper_config("flow_grpo_sd35", "trainer.total_training_steps=300")
    plan = plan_for(cfg, 2, 80.0)
    text = describe(cfg, plan, "flow_grpo_sd35")
    e = plan.estimate
    assert f"peak {e.peak_gb:.1f} GB = weights and state {e.resident_gb:.1f} + the larger of" in text
    step_s = e.step_s + e.communication_s
    assert e.communication_s > 0 and f"estimate per step: {step_s:.1f} s" in text
    assert f"whole run: 300 steps x {step_s:.1f} s = {300 * step_s / 3600:.1f} h" in text
    from conftest import gpu_node_memory

    wan = paper_config("dance_grpo_wan")
    with gpu_node_memory():  # the step's videos fit a GPU node's memory, not this machine's
        text = describe(wan, plan_for(wan, 1, 80.0), "dance_grpo_wan")
    assert "videos/s per GPU" in text and "images/s" not in text
    minutes = float(re.search(r"at ([\d.]+) minutes per step", text).group(1))
    assert minutes > 10 and "more GPUs shorten it" in text


def test_a_sequence_group_halves_each_gpus_activations_and_work_and_adds_its_all_to_alls():
    """DanceGRPO-Wan on 2 GPUs in one sequence group of 2 against 1 GPU holding whole samples
    (DDP, the same sizes): each GPU runs every forward of the same rows over half of each row's
    tokens, so the update's activations and the step's FLOPs per GPU halve and sampling memory
    (the decode of whole videos) stays. The communication is DDP's gradient all-reduce plus, per
    pass of a row through the denoiser (sampling, reference, training forward, backward), four
    all-to-alls per layer sending 1/2 of a local (S/2 x hidden) bf16 tensor."""
    cfg = paper_config("dance_grpo_wan")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, strategy="ddp"))
    split = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, sequence_parallel_size=2, n_workers=2))
    shape = model_shape(cfg)
    choice = Choice(1, False, 1, "ddp")
    one = estimate(cfg, shape, step_work(cfg, 1), 1, choice, 989.0)
    work = step_work(split, 2)
    assert work == step_work(cfg, 1)  # the group's GPUs hold the one GPU's rows
    two = estimate(split, shape, work, 2, choice, 989.0)
    assert two.update_gb == pytest.approx(one.update_gb / 2, rel=1e-12)
    assert two.step_flops == pytest.approx(one.step_flops / 2, rel=1e-12)
    assert (two.sampling_gb, two.resident_gb) == (one.sampling_gb, one.resident_gb)
    rows = work.trained_samples * work.substeps * work.rows_per_substep
    passes = (work.sampled_images * work.sampling_steps * work.branches + rows * work.no_grad_passes
              + rows * work.epochs * 2)
    all_to_all = passes * shape.layers * 4 * 0.5 * (shape.seq_tokens / 2 * shape.hidden * 2)
    lora = 0.5 * 2 * (cfg.model.lora_rank * 2 * shape.hidden * 8 * shape.layers * 4) * work.optimizer_steps
    assert two.communication_gb * 1e9 == pytest.approx(all_to_all + lora, rel=1e-9)
    assert "each row on 2 GPUs" in describe(split, plan_for(split, 2, 80), "dance_grpo_wan")
    with pytest.raises(ConfigError, match="in sequence groups of 2"):
        plan_for(split, 3, 80)


def test_a_two_expert_folder_holds_both_experts_and_trains_the_named_ones(tiny_wan22_path):
    """A Wan 2.2 A14B-layout folder: both experts' stored parameters are held; a full fine-tune of
    one expert keeps its float32 state and leaves the other in the compute dtype, LoRA puts
    adapters on the trained experts only, and FSDP2 gathers one expert per forward."""
    from safetensors.torch import load_file

    from pixelrl.config.plan import (DTYPE_BYTES, TRAINABLE_STATE_BYTES, communication_bytes, lora_parameters,
                                     resident_bytes)

    def stored(expert):
        return sum(t.numel() for f in (tiny_wan22_path / expert).glob("*.safetensors") for t in load_file(f).values())

    def config(*overrides):
        cfg = paper_config("dance_grpo_wan", f"model.path={tiny_wan22_path}", "model.max_sequence_length=16",
                           "model.num_frames=5", "rollout.resolution=64", *overrides)
        return cfg, model_shape(cfg)

    cfg, both = config("model.lora_rank=0", "actor.ema_decay=0")
    one_cfg, one = config("model.lora_rank=0", "actor.ema_decay=0", "model.trained_experts=[transformer_2]")
    assert both.denoiser_params == one.denoiser_params == stored("transformer") + stored("transformer_2")
    assert (both.experts, both.trained_experts, one.trained_experts) == (2, 2, 1)
    width = DTYPE_BYTES[cfg.model.dtype]
    # one expert's weights move from trained state to frozen compute-dtype weights
    saved = resident_bytes(cfg, both, 1) - resident_bytes(one_cfg, one, 1)
    assert saved == pytest.approx(one.expert_params * (TRAINABLE_STATE_BYTES - width))
    lora_cfg, lora_both = config("model.lora_rank=8")
    _, lora_one = config("model.lora_rank=8", "model.trained_experts=[transformer]")
    assert lora_parameters(lora_cfg, lora_both) == 2 * lora_parameters(lora_cfg, lora_one) > 0
    fsdp = dataclasses.replace(lora_cfg, trainer=dataclasses.replace(lora_cfg.trainer, strategy="fsdp2"))
    work = step_work(fsdp, 2)
    gathered = communication_bytes(fsdp, lora_both, work, 2, 1, 0)  # one forward, no backward
    assert gathered == pytest.approx(0.5 * lora_both.expert_params * width)
    assert "(2 experts, 1 trained)" in describe(one_cfg, plan_for(one_cfg, 8, 80.0), "dance_grpo_wan")
