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
    from pixelrl.models.parallelize import no_split_units

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
