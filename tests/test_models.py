import copy

import pytest
import torch

from pixelrl.core.errors import ModelFolderError
from pixelrl.models import SD3Model, load_model
from pixelrl.models.lora import adapters_disabled, add_lora


def test_tiny_folder_loads_in_diffusers_and_prompt_encoding_matches_it(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path, text_encoder_3=None, tokenizer_3=None)
    prompts = ["a red circle", "two blue squares on the left"]
    ref_embeds, _, ref_pooled, _ = pipe.encode_prompt(
        prompts, prompts, prompts, do_classifier_free_guidance=False, max_sequence_length=8
    )
    model = SD3Model(tiny_sd3_path, max_sequence_length=8)
    ours = model.encode_prompts(prompts)
    assert torch.allclose(ours.embeds, ref_embeds, atol=1e-6)
    assert torch.allclose(ours.pooled, ref_pooled, atol=1e-6)
    # and the pipeline samples from it
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                 max_sequence_length=8).images
    assert image.shape == (1, 32, 32, 3)


def test_default_tiny_folder_loads_in_diffusers_with_no_extra_arguments_and_t5_encoding_matches(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from pixelrl.models import build_tiny_sd3

    path = build_tiny_sd3(tmp_path / "default")
    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np",
                 max_sequence_length=12).images
    assert image.shape == (1, 32, 32, 3)
    prompts = ["a red circle", "three green stars above a tree"]
    ref_embeds, _, ref_pooled, _ = pipe.encode_prompt(
        prompts, prompts, prompts, do_classifier_free_guidance=False, max_sequence_length=12
    )
    model = SD3Model(path, max_sequence_length=12)
    ours = model.encode_prompts(prompts)
    assert model.t5_encoder is not None and ours.embeds.shape[1] == 32 + 12
    assert torch.allclose(ours.embeds, ref_embeds, atol=1e-6)
    assert torch.allclose(ours.pooled, ref_pooled, atol=1e-6)


def test_bfloat16_denoiser_keeps_the_step_math_in_float32(tiny_sd3_path):
    from pixelrl.sampling import SamplingSettings, Window, rollout, sigmas_from_scheduler

    model = SD3Model(tiny_sd3_path, dtype="bfloat16", max_sequence_length=0)
    assert next(model.transformer.parameters()).dtype == torch.bfloat16
    out = rollout(model, ["a cat"], [0], sigmas=sigmas_from_scheduler(model.scheduler, 4), window=Window(0, 2),
                  settings=SamplingSettings(guidance_scale=2.0), height=32, width=32)
    assert out.latents.dtype == torch.float32 and out.log_probs.dtype == torch.float32
    assert torch.isfinite(out.log_probs).all()


def test_prompt_cache_encodes_each_string_once(tiny_sd3_path):
    model = SD3Model(tiny_sd3_path, max_sequence_length=0)
    calls = []
    original = model._encode_uncached
    model._encode_uncached = lambda prompts: calls.append(list(prompts)) or original(prompts)
    first = model.encode_prompts(["a", "b", "a"])
    second = model.encode_prompts(["b", "c"])
    # one string per encoder call: an embedding must not depend on which prompts missed the cache
    # with it, or a resumed run (empty cache) would differ from an uninterrupted one
    assert calls == [["a"], ["b"], ["c"]]
    assert torch.equal(first.embeds[0], first.embeds[2]) and torch.equal(first.embeds[1], second.embeds[0])


def test_cfg_is_one_batched_forward_and_combines_branches(tiny_sd3_path):
    model = SD3Model(tiny_sd3_path, max_sequence_length=0)
    batch_sizes = []
    hook = model.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: batch_sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    x = torch.randn(3, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor(0.7)
    text = model.encode_prompts(["a red circle", "a cat", "a dog"])
    neg = model.encode_prompts([""] * 3)
    guided = model.predict_velocity(x, sigma, text, guidance_scale=4.0, negative=neg)
    assert batch_sizes == [6]
    hook.remove()
    v_cond = model.predict_velocity(x, sigma, text)
    v_uncond = model.predict_velocity(x, sigma, neg)
    assert torch.allclose(guided, v_uncond + 4.0 * (v_cond - v_uncond), atol=1e-5)


def test_decode_gives_uint8_images(tiny_sd3_path, tiny_pixel_path):
    for path in (tiny_sd3_path, tiny_pixel_path):
        model = SD3Model(path, max_sequence_length=0)
        x = torch.randn(2, *model.latent_shape(32, 32))
        images = model.decode(x)
        assert images.dtype == torch.uint8 and images.shape == (2, 32, 32, 3)
    assert SD3Model(tiny_sd3_path, max_sequence_length=0).latent_shape(32, 32) == (4, 16, 16)
    assert SD3Model(tiny_pixel_path, max_sequence_length=0).latent_shape(32, 32) == (3, 32, 32)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist: set model.path"):
        load_model("sd3", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match=r"lacks the component folder\(s\) \['transformer', 'scheduler'\]"):
        load_model("sd3", tmp_path / "empty")


def test_lora_trains_only_adapters_and_disabling_gives_the_base_model(tiny_sd3_path):
    model = SD3Model(tiny_sd3_path, max_sequence_length=0)
    x = torch.randn(2, *model.latent_shape(32, 32))
    text = model.encode_prompts(["a", "b"])
    base = model.predict_velocity(x, torch.tensor(0.5), text)
    add_lora(model.transformer, rank=4, alpha=8, target_modules=model.default_lora_targets)
    names = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    with torch.no_grad():
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)
    adapted = model.predict_velocity(x, torch.tensor(0.5), text)
    assert not torch.allclose(adapted, base)
    with adapters_disabled(model.transformer):
        assert torch.equal(model.predict_velocity(x, torch.tensor(0.5), text), base)


def test_a_folder_of_another_family_is_refused_with_model_type_named(tmp_path, tiny_pixel_path):
    import json
    import shutil

    from pixelrl.core.errors import ConfigError
    from pixelrl.models.loader import check_model_type, folder_model_type, load_folder_model

    assert folder_model_type(tiny_pixel_path) == "sd3"
    assert isinstance(load_folder_model(tiny_pixel_path), SD3Model)  # eval / generate pick the family
    check_model_type("sd3", tiny_pixel_path)
    other = tmp_path / "other"
    shutil.copytree(tiny_pixel_path, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyPipeline"}))
    with pytest.raises(ConfigError, match="model.type.*holds a KandinskyPipeline folder"):
        check_model_type("sd3", other)
    with pytest.raises(ModelFolderError, match="no family"):
        load_folder_model(other)


def test_fsdp_units_are_the_blocks_the_family_declares_unsplittable(tiny_pixel_path):
    from pixelrl.parallel.fsdp import no_split_units

    model = SD3Model(tiny_pixel_path)
    units = model.fsdp_units()
    assert units == list(model.transformer.transformer_blocks)
    with pytest.raises(ValueError, match="declares no `_no_split_modules`"):
        no_split_units(torch.nn.Linear(2, 2))


def test_a_folder_loads_with_the_options_it_declares(tmp_path, tiny_pixel_path):
    """A pipeline folder's pixelrl_model.json (the shapes models: zero T5 tokens) sets how eval
    loads it and is enforced on a training config; a folder without one takes the family's
    defaults; a malformed one is one clear error."""
    import shutil

    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError, ModelFolderError
    from pixelrl.trainers.checkpointing import load_for_eval

    assert load_for_eval("builtin:shapes").max_sequence_length == 0
    assert load_for_eval(str(tiny_pixel_path)).max_sequence_length == 256
    folder = tmp_path / "declared"
    shutil.copytree(tiny_pixel_path, folder)
    (folder / "pixelrl_model.json").write_text('{"max_sequence_length": 0}')
    assert load_for_eval(str(folder)).max_sequence_length == 0
    with pytest.raises(ConfigError, match="model.max_sequence_length.*set model.max_sequence_length=0"):
        load_config("shapes_flow_grpo", [f"model.path={folder}", "model.max_sequence_length=77"])
    load_config("shapes_flow_grpo", [f"model.path={folder}"])
    (folder / "pixelrl_model.json").write_text('{"max_sequence_length": "zero"}')
    with pytest.raises(ModelFolderError, match="pixelrl_model.json.*integer options"):
        load_for_eval(str(folder))



def test_fused_rms_norm_computes_diffusers_rms_norm_and_keeps_its_parameters():
    from diffusers.models.normalization import RMSNorm

    from pixelrl.models.kernels import fuse_rms_norms

    torch.manual_seed(0)
    plain = torch.nn.Sequential(RMSNorm(64, eps=1e-6), RMSNorm(64, eps=1e-6, elementwise_affine=False))
    plain[0].weight.data.normal_()
    fused = copy.deepcopy(plain)
    assert fuse_rms_norms(fused) == 1  # the affine one; the weightless one stays diffusers'
    assert isinstance(fused[0], RMSNorm) and type(fused[0]).__name__ == "FusedRMSNorm" and type(fused[1]) is RMSNorm
    assert list(fused.state_dict()) == list(plain.state_dict())
    x = torch.randn(3, 5, 64) * 4
    assert torch.equal(fused(x), plain(x))  # float32: bitwise
    plain, fused = plain.bfloat16(), fused.bfloat16()
    assert torch.equal(fused(x), plain(x))  # a float32 input to bf16 weights: diffusers' own path
    # bf16 within two roundings (F.rms_norm may round once where diffusers rounds twice)
    torch.testing.assert_close(fused(x.bfloat16()), plain(x.bfloat16()), atol=0, rtol=2 ** -6)


def test_loaded_denoisers_run_their_rms_norms_fused(tiny_qwen_image_path):
    from pixelrl.models import load_model
    from pixelrl.models.kernels import FusedRMSNorm

    model = load_model("qwen_image", tiny_qwen_image_path, max_sequence_length=8)
    fused = [m for m in model.transformer.modules() if isinstance(m, FusedRMSNorm)]
    assert fused, "Qwen-Image's q/k and text norms are diffusers RMSNorms: they should load fused"


def test_bf16_denoisers_train_float32_adapters_that_multiply_in_bf16(tiny_sd3_path):
    """A bf16 denoiser's LoRA weights are float32 (an AdamW step far under a bf16 weight's
    rounding still moves them) and multiply in bf16, as under torch.autocast; its old-policy copy
    is float32 too and equal to the source; a float32 denoiser is untouched."""
    from peft.tuners.lora import LoraLayer

    from pixelrl.models.kernels import AdapterFactorLinear
    from pixelrl.models.lora import add_adapter_copy, adapter_params

    model = SD3Model(tiny_sd3_path, dtype="bfloat16", max_sequence_length=0)
    add_lora(model.transformer, rank=4, alpha=8, target_modules=model.default_lora_targets)
    trained = [p for p in model.transformer.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    layer = next(m for m in model.transformer.modules() if isinstance(m, LoraLayer))
    A, B = layer.lora_A["default"], layer.lora_B["default"]
    assert type(A) is AdapterFactorLinear and layer.get_base_layer().weight.dtype == torch.bfloat16
    with torch.no_grad():
        B.weight.normal_()
    x = torch.randn(6, A.in_features, dtype=torch.bfloat16)
    out = layer(x)
    expected = layer.base_layer(x) + (x @ A.weight.bfloat16().T) @ B.weight.bfloat16().T * layer.scaling["default"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().square().sum().backward()
    assert A.weight.grad.dtype == torch.float32 and A.weight.grad.abs().sum() > 0
    before = A.weight.detach().clone()
    with torch.no_grad():
        A.weight.add_(before.abs().clamp_min(1e-3) * 1e-4)  # 1/10000 of each weight: lost in bf16
    assert (A.weight != before).all()
    add_adapter_copy(model.transformer, "old")
    old, new = adapter_params(model.transformer, "old"), adapter_params(model.transformer, "default")
    assert all(old[k].dtype == torch.float32 and torch.equal(old[k], new[k]) for k in new)
    float_model = SD3Model(tiny_sd3_path, max_sequence_length=0)
    add_lora(float_model.transformer, rank=4, alpha=8, target_modules=float_model.default_lora_targets)
    assert not any(isinstance(m, AdapterFactorLinear) for m in float_model.transformer.modules())


def test_fsdp2_gathers_float32_master_weights_in_the_compute_dtype(tiny_sd3_path):
    """Full fine-tuning of a bf16 model under FSDP2: the float32 shards are all-gathered as bf16
    (half the bytes, what `pixelrl plan` counts) and the gradients come back float32."""
    import torch.distributed as dist

    from pixelrl.parallel.fsdp import apply_fsdp2

    model = SD3Model(tiny_sd3_path, dtype="bfloat16", max_sequence_length=0)
    model.keep_float32_master_weights()
    model.transformer.requires_grad_(True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    projection = model.fsdp_units()[0].attn.to_q
    try:
        apply_fsdp2(model)
        gathered = []
        projection.register_forward_pre_hook(lambda m, a: gathered.append(m.weight.dtype))
        x = torch.randn(2, *model.latent_shape(32, 32))
        model.predict_velocity(x, torch.tensor(0.5), model.encode_prompts(["a", "b"])).square().mean().backward()
    finally:
        dist.destroy_process_group()
    assert gathered == [torch.bfloat16]
    assert projection.weight.dtype == torch.float32 and projection.weight.grad.dtype == torch.float32
