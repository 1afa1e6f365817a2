"""Every model family through the same RL code: prompt encoding and ODE samples equal to the
family's own diffusers pipeline, its LoRA checkpoint loading into that pipeline, its FSDP units,
and Flow-GRPO moving a reward on its tiny model."""

import pytest
import torch

from conftest import assert_learned, tiny_config
from pixelrl.engine import PolicyEngine
from pixelrl.models import model_family

# family -> (fixture of its tiny folder, model.* / rollout.* settings the tiny folder needs)
FAMILIES = {
    "sd3": ("tiny_sd3_path", dict(model__max_sequence_length=8, rollout__guidance_scale=4.5)),
    "flux": ("tiny_flux_path", dict(model__max_sequence_length=16, rollout__guidance_scale=3.5)),
    "qwen_image": ("tiny_qwen_image_path", dict(model__max_sequence_length=64, rollout__guidance_scale=4.0,
                                                rollout__negative_prompt=" ")),
    "wan": ("tiny_wan_path", dict(model__max_sequence_length=16, model__num_frames=5, rollout__guidance_scale=4.0)),
}
# other layouts of a family, tested as it is against its pipeline: case -> (family, fixture of its folder).
# Wan 2.2 TI2V-5B as text-to-video: WanPipeline gives its transformer one timestep per token (all
# equal without an image) where pixelrl gives one per row; its residual VAE has 4x-wider cells.
LAYOUTS = {"wan_ti2v": ("wan", "tiny_wan_ti2v_path")}
PROMPTS = ["a red circle", "two blue squares on the left"]


def _config(request, case, **overrides):
    family, fixture = LAYOUTS[case] if case in LAYOUTS else (case, FAMILIES[case][0])
    return tiny_config(request.getfixturevalue(fixture), model__type=family, **{**FAMILIES[family][1], **overrides})


def _pipeline_latents(family, pipe, cfg, prompt, seed):
    """The family's diffusers pipeline's ODE sample, as unpacked latents [1, C, h, w]."""
    kwargs = dict(num_inference_steps=cfg.rollout.num_steps, height=32, width=32, output_type="latent",
                  max_sequence_length=cfg.model.max_sequence_length, generator=torch.Generator().manual_seed(seed))
    if family == "qwen_image":  # true CFG: a negative prompt and true_cfg_scale
        kwargs.update(true_cfg_scale=cfg.rollout.guidance_scale, negative_prompt=cfg.rollout.negative_prompt)
    else:
        kwargs.update(guidance_scale=cfg.rollout.guidance_scale)
    if family == "wan":  # a video pipeline: frames, and `.frames` holds the latents
        kwargs.update(num_frames=cfg.model.num_frames, negative_prompt=cfg.rollout.negative_prompt)
        return pipe(prompt, **kwargs).frames
    latents = pipe(prompt, **kwargs).images
    if family != "sd3":  # FLUX and Qwen-Image return packed latents for output_type="latent"
        latents = pipe._unpack_latents(latents, 32, 32, pipe.vae_scale_factor)
    return latents.flatten(1, -3)  # Qwen-Image: its one-frame axis dropped


def _our_latents(engine, prompts, seeds):
    from pixelrl.sampling import SamplingSettings, Window, rollout

    settings = SamplingSettings(noise_level=0.0, guidance_scale=engine.cfg.rollout.guidance_scale)
    with torch.no_grad():
        return rollout(engine.model, prompts, seeds, sigmas=engine.sigmas, window=Window(0, 0), settings=settings,
                       height=32, width=32).final_latents


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_encoding_equals_the_family_pipelines_encode_prompt(request, family):
    cfg = _config(request, family)
    model = model_family(family)(cfg.model.path, max_sequence_length=cfg.model.max_sequence_length,
                                 num_frames=cfg.model.num_frames)
    pipe = model_family(family).load_pipeline(model.path)
    ours = model.encode_prompts(PROMPTS)
    if family == "sd3":
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, PROMPTS, PROMPTS, do_classifier_free_guidance=False,
                                                  max_sequence_length=cfg.model.max_sequence_length)
    elif family == "flux":
        embeds, pooled, _ = pipe.encode_prompt(PROMPTS, PROMPTS, max_sequence_length=cfg.model.max_sequence_length)
    elif family == "wan":  # UMT5 states, zero past each prompt, padded to max_sequence_length
        embeds, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                       max_sequence_length=cfg.model.max_sequence_length)
        pooled = None
    else:  # Qwen-Image: no pooled vector; prompts differ in length, so a mask marks the padding
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=cfg.model.max_sequence_length)
        pooled = None
        assert torch.equal(ours.mask, mask) and not mask.all()
    assert torch.allclose(ours.embeds, embeds, atol=1e-6)
    assert pooled is None and ours.pooled is None or torch.allclose(ours.pooled, pooled, atol=1e-6)


@pytest.mark.parametrize("case", sorted(FAMILIES) + sorted(LAYOUTS))
def test_ode_sample_and_saved_lora_equal_the_family_pipeline(request, tmp_path, case):
    """pixelrl's ODE sample from a seed is the pipeline's (same schedule, guidance, latent layout);
    after training-like LoRA changes, the checkpoint's adapter loads into the pipeline with
    `load_lora_weights` and both still sample the same latents."""
    from pixelrl.engine.checkpoint import save_engine

    family = LAYOUTS.get(case, (case,))[0]
    cfg = _config(request, case, rollout__num_steps=4)
    engine = PolicyEngine.from_config(cfg)
    pipe = model_family(family).load_pipeline(engine.model.path)
    expected = torch.cat([_pipeline_latents(family, pipe, cfg, p, seed) for p, seed in zip(PROMPTS, (3, 4))])
    assert torch.allclose(_our_latents(engine, PROMPTS, [3, 4]), expected, atol=1e-5)

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.transformer.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an effect
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    save_engine(engine, tmp_path / "actor")
    pipe.load_lora_weights(tmp_path / "actor" / "adapter")
    tuned = torch.cat([_pipeline_latents(family, pipe, cfg, p, seed) for p, seed in zip(PROMPTS, (3, 4))])
    assert (tuned - expected).abs().max() > 1e-3  # the adapter changed the pipeline's samples ...
    assert torch.allclose(_our_latents(engine, PROMPTS, [3, 4]), tuned, atol=1e-5)  # ... exactly as ours


def test_flux_is_guidance_distilled_and_sharded_over_its_double_and_single_blocks(tiny_flux_path):
    from pixelrl.models.flux import FluxModel

    model = FluxModel(tiny_flux_path, max_sequence_length=16)
    assert model.negative_embeds("", 2, 3.5) is None  # no CFG batch: guidance is an input
    units = [type(m).__name__ for m in model.fsdp_units()]
    assert units == ["FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxSingleTransformerBlock"]
    # the guidance embedding is used: another scale gives another velocity from the same input
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    text, sigma = model.encode_prompts(["a cat"]), torch.tensor([0.7])
    assert not torch.allclose(model.predict_velocity(x, sigma, text, guidance_scale=1.0),
                              model.predict_velocity(x, sigma, text, guidance_scale=5.0))
    # dynamic shifting: the schedule depends on the image size, as FluxPipeline's does
    assert not torch.equal(model.sigmas(6, 32, 32), model.sigmas(6, 64, 64))


def test_qwen_image_guides_with_a_negative_branch_and_shards_its_blocks(tiny_qwen_image_path):
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError
    from pixelrl.models.qwen_image import QwenImageModel

    model = QwenImageModel(tiny_qwen_image_path, max_sequence_length=64)
    negative = model.negative_embeds(" ", 2, 4.0)  # true CFG: the unconditional branch is encoded
    assert negative is not None and negative.mask is not None and model.negative_embeds(" ", 2, 1.0) is None
    assert [type(m).__name__ for m in model.fsdp_units()] == ["QwenImageTransformerBlock"] * 2
    with pytest.raises(ConfigError, match="model.max_sequence_length"):
        load_config("flow_grpo_qwen_image_tiny", [f"model.path={tiny_qwen_image_path}", "model.max_sequence_length=0"])


def test_wan_samples_videos_and_refuses_frame_counts_its_vae_cannot_take(tiny_wan_path, tiny_pixel_path):
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError
    from pixelrl.models.wan import WanModel

    model = WanModel(tiny_wan_path, max_sequence_length=16, num_frames=5)
    assert model.latent_shape(32, 32) == (4, 3, 16, 16)  # 1 + 4 frames -> 1 + 2 latent frames (2x temporal)
    videos = model.decode(torch.randn(2, 4, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    assert videos.shape == (2, 5, 32, 32, 3) and videos.dtype == torch.uint8
    assert model.encode(videos).shape == (2, 4, 3, 16, 16)
    assert [type(m).__name__ for m in model.fsdp_units()] == ["WanTransformerBlock"] * 2
    with pytest.raises(ConfigError, match="model.num_frames.*2k \\+ 1 frames"):
        load_config("flow_grpo_wan_tiny", [f"model.path={tiny_wan_path}", "model.num_frames=4"])
    with pytest.raises(ConfigError, match="model.num_frames.*makes images"):
        load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "model.num_frames=5"])


def test_flux_refuses_zero_t5_tokens_and_an_image_size_its_packing_cannot_take(tiny_flux_path):
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    base = [f"model.path={tiny_flux_path}"]
    with pytest.raises(ConfigError, match="model.max_sequence_length"):
        load_config("flow_grpo_flux_tiny", [*base, "model.max_sequence_length=0"])
    with pytest.raises(ConfigError, match="rollout.resolution.*multiple of 4"):
        load_config("flow_grpo_flux_tiny", [*base, "rollout.resolution=30"])
    with pytest.raises(ConfigError, match="model.type.*FluxPipeline folder.*model.type=flux"):
        load_config("flow_grpo_tiny", base)


@pytest.mark.learning
# SD3: tests/test_learning.py; ~20 s each, so Qwen-Image and Wan run with `pytest -m slow`
@pytest.mark.parametrize("family", ["flux", pytest.param("qwen_image", marks=pytest.mark.slow),
                                    pytest.param("wan", marks=pytest.mark.slow)])
def test_flow_grpo_moves_the_reward_and_exports_a_pipeline_diffusers_loads(request, tmp_path, family):
    """The whole trainer (one process) on the family's tiny model: the JPEG-compressibility reward
    of the policy rises on unseen seeds, and `pixelrl export` writes a folder the family's pipeline
    loads with the LoRA fused in, sampling what pixelrl samples."""
    from pixelrl.cli import main
    from pixelrl.config import load_config
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.evaluate import fixed_seed_reward
    from pixelrl.rewards import WeightedReward
    from pixelrl.trainers.controller import DiffusionTrainer

    steps, path = 16, request.getfixturevalue(FAMILIES[family][0])
    cfg = load_config(f"flow_grpo_{family}_tiny", [f"model.path={path}", "trainer.backend=local",
                                                   f"trainer.total_training_steps={steps}", "trainer.logger=[jsonl]",
                                                   f"trainer.default_local_dir={tmp_path}"])
    engine, reward = PolicyEngine.from_config(cfg), WeightedReward.from_functions(cfg.reward.functions)
    prompts, seeds = cfg.data.prompts[:4] * 4, list(range(10_000, 10_016))
    before = fixed_seed_reward(engine, reward, prompts, seeds)
    result = DiffusionTrainer(cfg).fit()
    checkpoint = f"{result['run_dir']}/checkpoints/global_step_{steps}"
    load_engine(engine, f"{checkpoint}/actor")
    after = fixed_seed_reward(engine, reward, prompts, seeds)
    # JPEG kB; measured +0.075 (FLUX), +0.043 (Qwen-Image), +0.067 (Wan, per-frame reward averaged)
    assert_learned(before, after, 0.03)

    assert main(["export", checkpoint, str(tmp_path / "exported")]) == 0
    pipe = model_family(family).pipeline_class().from_pretrained(tmp_path / "exported")
    ours = _our_latents(engine, ["a red circle"], [5])
    theirs = _pipeline_latents(family, pipe, cfg, "a red circle", 5)
    assert torch.allclose(ours, theirs, atol=1e-4)  # fused weights: float reordering only


@pytest.mark.slow  # ~20-60 s each: the compiled run compiles every block structure of the family
# SD3's compiled blocks as they are; the others' with gradient checkpointing too, which the `auto`
# sizes choose where memory is short (FLUX on 8 GPUs)
@pytest.mark.parametrize("family, checkpointed", [("sd3", False), ("flux", True), ("qwen_image", True),
                                                  ("wan", True)])
def test_compiled_blocks_update_each_family_as_the_eager_blocks(request, family, checkpointed):
    """model.compile (each block compiled), which the paper configs turn on for a GPU
    (model.compile=auto): the same images, log-probs, reference scores, metrics and weights after
    an update as the eager, unchecked blocks, up to float reordering; FLOPs are still counted;
    LoRA names are kept."""
    from torch._dynamo.utils import counters

    from pixelrl.trainers.step import compute_advantages, expand_prompts

    runs = []
    for compiled in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        cfg = _config(request, family, model__compile=compiled, model__gradient_checkpointing=compiled and checkpointed,
                      diffusion_loss__kl_coef=0.04, actor__ppo_micro_batch_size=4)
        engine = PolicyEngine.from_config(cfg)
        trained = {n: p for n, p in engine.model.transformer.named_parameters() if p.requires_grad}
        start = {n: p.detach().clone() for n, p in trained.items()}
        samples = expand_prompts(PROMPTS, [{}] * 2, cfg.rollout.n, seed=1)
        batch = engine.rollout(samples["prompts"], samples["seeds"])
        batch["uids"] = samples["uids"]
        batch["rewards"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
        batch["advantages"] = compute_advantages(batch["rewards"], batch["uids"], cfg.algorithm)
        batch.update(engine.score(batch, "reference"))
        metrics = engine.update(batch)
        runs.append((batch, metrics, start, {n: p.detach().clone() for n, p in trained.items()}))
        assert (counters["stats"]["unique_graphs"] > graphs) == compiled  # the eager run compiled nothing
    (b_eager, m_eager, start, w_eager), (b_comp, m_comp, _, w_comp) = runs
    assert w_comp.keys() == w_eager.keys() and any("lora" in n for n in w_comp)
    torch.testing.assert_close(b_comp["log_probs"], b_eager["log_probs"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b_comp["ref_log_probs"], b_eager["ref_log_probs"], rtol=1e-4, atol=1e-5)
    assert (b_comp["images"].int() - b_eager["images"].int()).abs().max() <= 1
    for key in ("pg_loss", "kl", "grad_norm"):
        assert m_comp[key] == pytest.approx(m_eager[key], rel=1e-3, abs=1e-7), key
    assert m_comp["perf/tflop"] == pytest.approx(m_eager["perf/tflop"], rel=1e-6)
    update = max((w_eager[n] - start[n]).abs().max().item() for n in w_eager)
    apart = max((w_eager[n] - p).abs().max().item() for n, p in w_comp.items())
    assert update > 1e-3 and apart < 1e-2 * update


NFT_LR = {"flux": 3e-2, "qwen_image": 1e-1, "wan": 5e-2}


@pytest.mark.learning
@pytest.mark.slow  # ~25 s each; the default run has NFT on SD3 (test_direct_preference.py) and Flow-GRPO per family
@pytest.mark.parametrize("family", sorted(NFT_LR))
def test_diffusion_nft_moves_the_reward_on_each_family(request, family):
    """The direct-preference trainer's step with DiffusionNFT (forward-process loss on the final
    clean latents, old adapter as the rollout policy, deterministic sampler) on the family's tiny
    model: a fixed-seed evaluation of unseen seeds improves."""
    from pixelrl.engine.evaluate import fixed_seed_reward
    from pixelrl.rewards import WeightedReward
    from pixelrl.testing import forward_process_step

    cfg = _config(request, family, algorithm__trainer_type="forward_process", diffusion_loss__name="diffusion_nft",
                  diffusion_loss__params={"rollout_policy": "old"}, rollout__noise_level=0.0, actor__lr=NFT_LR[family])
    cfg.data.train_batch_size = 4
    engine, reward = PolicyEngine.from_config(cfg), WeightedReward.from_functions(cfg.reward.functions)
    prompts = ["a red circle", "two blue squares", "a cat", "a house"]
    before = fixed_seed_reward(engine, reward, prompts * 4, list(range(10_000, 10_016)))
    history = [forward_process_step(engine, reward, prompts, [{}] * 4, step, cfg)[1] for step in range(1, 13)]
    after = fixed_seed_reward(engine, reward, prompts * 4, list(range(10_000, 10_016)))
    assert_learned(before, after, 0.03)
    assert all(m["actor/skipped_nonfinite"] == 0.0 for m in history)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_generate_from_a_model_folder_picks_its_family_and_defaults(request, tmp_path, family):
    """`pixelrl generate --model DIR` reads the family from the folder's model_index.json and loads it
    with that family's defaults (FLUX needs T5 tokens; Wan samples videos, shown by a frame). The
    size is the flag's here: a tiny folder's pipeline default is its family's (FLUX: 128 latents x
    the tiny VAE's 2 = 256 px), and Wan's pipeline has no single one."""
    from PIL import Image

    from pixelrl.cli import main

    out = tmp_path / "grid.png"
    path = request.getfixturevalue(FAMILIES[family][0])
    assert main(["generate", "--model", str(path), "--prompt", "a cat", "--n", "2", "--steps", "2",
                 "--resolution", "32", "--out", str(out)]) == 0
    assert Image.open(out).size[0] == 2 * 32 * 4  # two 32 px samples side by side at scale 4
