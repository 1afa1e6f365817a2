"""Qwen-Image-Edit (`QwenImageEditPlusPipeline`): the family whose text encoder reads the source
as well as the instruction, checked against the diffusers pipeline on a tiny folder."""

import pytest
import torch

from conftest import check_edits_match_pipeline, random_sources, tiny_config
from pixelrl.engine import PolicyEngine
from pixelrl.models import model_family

PROMPTS = ["make the red circle blue", "add a square"]


def _model(path):
    return model_family("qwen_image_edit")(path, max_sequence_length=64)


def test_the_tiny_tokenizer_drops_exactly_the_edit_template(tiny_qwen_edit_path):
    """The pipeline drops the first 64 tokens of every encoded instruction (its system prompt, in
    Qwen2's BPE): the tiny tokenizer must spell the template in 64 tokens too, so what is kept
    starts at "Picture 1:"."""
    model = _model(tiny_qwen_edit_path)
    pipe = model.pipeline
    text = pipe.prompt_template_encode.format("Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it blue")
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(text)["input_ids"])
    assert "<unk>" not in tokens
    assert tokens[pipe.prompt_template_encode_start_idx:][:3] == ["Picture", "1", ":"]


def test_the_text_embedding_reads_the_source_and_both_branches_carry_it(tiny_qwen_edit_path):
    """The same instruction on two sources gives two text embeddings (the vision tower's tokens are
    in it), cached by content: the same bits alone and in a batch; the negative prompt is encoded
    under each row's source too."""
    model = _model(tiny_qwen_edit_path)
    first, second = random_sources(0)
    both = model.encode_conditions(["make it blue"] * 2, [first, second])
    assert not torch.equal(both.embeds[0], both.embeds[1])
    model._prompt_cache.clear()
    alone = model.encode_conditions(["make it blue"], [second])
    assert torch.equal(alone.embeds[0], both.embeds[1]) and torch.equal(alone.mask[0], both.mask[1])
    negative = model.negative_embeds(" ", 2, 4.0, [first, second])
    assert torch.equal(negative.condition_latents, both.condition_latents)
    assert not torch.equal(negative.embeds[0], negative.embeds[1])


@pytest.mark.parametrize("guidance, pictures", [(1.0, 1), (4.0, 1), (4.0, 2)])
def test_ode_edit_and_saved_lora_equal_qwen_image_edit_plus_pipeline(tiny_qwen_edit_path, tmp_path, monkeypatch,
                                                                       guidance, pictures):
    """pixelrl's ODE edit of a source from a seed is `QwenImageEditPlusPipeline`'s (the text encoder
    seeing the source, its latents appended with their own img_shapes, 2511's zero_cond_t, true
    CFG with both branches on the source), before and after a LoRA the checkpoint writes; with two
    pictures a row ("Picture 1: ... Picture 2: ...", both latents appended) as with one. The
    pipeline's VAE view of the source is set to the output's area, pixelrl's rule (the module's
    1024 x 1024 area is the releases' training size)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    from PIL import Image

    from pixelrl.sampling import SamplingSettings, Window, rollout

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 32 * 32)
    cfg = tiny_config(tiny_qwen_edit_path, model__type="qwen_image_edit", model__max_sequence_length=64,
                      rollout__num_steps=4, rollout__guidance_scale=guidance, rollout__negative_prompt=" ")
    engine = PolicyEngine.from_config(cfg)
    pipe = model_family("qwen_image_edit").load_pipeline(engine.model.path)
    sources = random_sources(1)
    if pictures == 2:
        sources = [(first, second) for (first,), (second,) in zip(sources, random_sources(7))]

    def pipeline_latents():
        out = []
        for prompt, row, seed in zip(PROMPTS, sources, (3, 4)):
            packed = pipe(prompt=prompt, image=[Image.fromarray(source.numpy()) for source in row], height=32, width=32,
                          num_inference_steps=4, true_cfg_scale=guidance, negative_prompt=" ", output_type="latent",
                          generator=torch.Generator().manual_seed(seed)).images
            out.append(pipe._unpack_latents(packed, 32, 32, pipe.vae_scale_factor)[:, :, 0])
        return torch.cat(out)

    def our_latents(images=sources):
        settings = SamplingSettings(noise_level=0.0, guidance_scale=guidance)
        with torch.no_grad():
            return rollout(engine.model, PROMPTS, [3, 4], sigmas=engine.sigmas, window=Window(0, 0),
                           settings=settings, height=32, width=32, condition_images=images,
                           negative_prompt=" ").final_latents

    check_edits_match_pipeline(engine, pipe, pipeline_latents, our_latents, sources, tmp_path)


def test_a_condition_survives_rollout_rescore_and_reference_bitwise(tiny_qwen_edit_path):
    engine = PolicyEngine.from_config(tiny_config(tiny_qwen_edit_path, model__type="qwen_image_edit",
                                                  model__max_sequence_length=64, rollout__guidance_scale=4.0,
                                                  rollout__negative_prompt=" "))
    sources = random_sources(2)
    batch = engine.rollout(PROMPTS, [5, 6], condition_images=sources)
    assert torch.equal(engine.score(batch, "current")["old_log_probs"], batch["log_probs"])
    assert torch.equal(engine.score(batch, "reference")["ref_log_probs"], batch["log_probs"])


def test_a_full_export_is_a_folder_the_edit_pipeline_loads(tiny_qwen_edit_path, tmp_path):
    """The exported folder keeps transformers' processor layout (diffusers cannot save pixelrl's
    torchvision-free processor itself): model_index.json names Qwen2VLProcessor, processor/ holds
    the tokenizer and the image processor, and the merged pipeline loads and encodes with it."""
    import json

    from pixelrl.engine.checkpoint import save_engine
    from pixelrl.models.export import export_checkpoint

    engine = PolicyEngine.from_config(tiny_config(tiny_qwen_edit_path, model__type="qwen_image_edit",
                                                  model__max_sequence_length=64))
    save_engine(engine, tmp_path / "actor")
    out = export_checkpoint(tmp_path / "actor", tiny_qwen_edit_path, tmp_path / "export", model_type="qwen_image_edit")
    assert json.loads((out / "model_index.json").read_text())["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert (out / "processor" / "preprocessor_config.json").is_file()
    source = random_sources(5, 1)
    exported = _model(out).encode_conditions(["make it blue"], source)
    assert torch.equal(exported.embeds, _model(tiny_qwen_edit_path).encode_conditions(["make it blue"], source).embeds)


def test_generate_takes_up_to_three_pictures(tiny_qwen_edit_path, tmp_path):
    """`pixelrl generate --image a --image b` gives every sample both pictures in order; a fourth is
    refused by the flag, before anything samples."""
    from PIL import Image

    from pixelrl.cli.shapes import edit_sources
    from pixelrl.core.errors import ConfigError

    model = _model(tiny_qwen_edit_path)
    for i, colour in enumerate([(200, 0, 0), (0, 0, 200)]):
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{i}.png")
    pictures = [str(tmp_path / "0.png"), str(tmp_path / "1.png")]
    rows, size = edit_sources(model, pictures, 3, 32)
    assert size == (32, 32) and len(rows) == 3 and all(len(row) == 2 for row in rows)
    assert tuple(rows[0][0][0, 0].tolist()) == (200, 0, 0) and tuple(rows[0][1][0, 0].tolist()) == (0, 0, 200)
    with pytest.raises(ConfigError, match=r"--image.*at most 3"):
        edit_sources(model, pictures * 2, 1, 32)
    Image.new("RGB", (96, 32), (0, 200, 0)).save(tmp_path / "wide.png")  # the last picture sets the aspect
    rows, size = edit_sources(model, [*pictures, str(tmp_path / "wide.png")], 1, 32)
    assert size == (32, 64) and all(picture.shape == (32, 64, 3) for picture in rows[0])


def test_the_output_size_is_the_pipelines_calculate_dimensions(tiny_qwen_edit_path):
    """An edit's output size in its source's aspect is QwenImageEditPlusPipeline's (1024 x 1024 area,
    sides rounded to 32 px) for wide, tall, square and odd sources."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    model = _model(tiny_qwen_edit_path)
    for width, height in [(1600, 900), (900, 1600), (1000, 1000), (1234, 567), (640, 480)]:
        expected_width, expected_height = calculate_dimensions(1024 * 1024, width / height)
        assert model.edit_output_size(1024, width, height) == (expected_height, expected_width)
