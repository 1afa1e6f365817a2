"""ImageReward on a tiny random BLIP written offline: the converter reads the released checkpoint
layout, the score is transformers' own BLIP image-text feature through the head, standardised
with ImageReward's constants; batching, determinism and damaged inputs."""

import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.testing import build_tiny_blip_itm
from pixelrl.rewards import get_reward
from pixelrl.rewards.clip import aesthetic_head
from pixelrl.rewards.image_reward import MEAN, STD, convert_checkpoint

PROMPTS = ["a red circle", "two blue squares", "a cat on a house", "a green tree", "a flower"]
HIDDEN = 32


def images(batch=5, size=40, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))


def _released_layout(model) -> dict[str, torch.Tensor]:
    """The tensors of a BLIP model under the names ImageReward.pt uses (BLIP's timm-style ViT,
    its BERT text encoder), written out by hand from the reference's module layout."""
    vision = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
              "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
              "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
              "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}
    per_block = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.qkv": "attn.qkv",
                 "self_attn.projection": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("vision_model."):
            rest = name[len("vision_model."):]
            if rest in vision:
                out["blip.visual_encoder." + vision[rest]] = tensor.clone()
            else:
                index, module, param = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest).groups()
                out[f"blip.visual_encoder.blocks.{index}.{per_block[module]}.{param}"] = tensor.clone()
        elif name.startswith("text_encoder."):
            out["blip." + name] = tensor.clone()
        elif name.startswith(("vision_proj.", "text_proj.")):
            out["blip." + name] = tensor.clone()
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(ImageReward.pt in the released layout, the BLIP folder it was drawn from, its head)."""
    from transformers import BlipForImageTextRetrieval

    root = tmp_path_factory.mktemp("image_reward")
    blip = build_tiny_blip_itm(root / "blip", hidden=HIDDEN)
    model = BlipForImageTextRetrieval.from_pretrained(blip)
    with torch.no_grad():  # BERT's 0.02 init leaves the image's share of the [CLS] feature ~1e-4: make it count
        for name, param in model.named_parameters():
            if "crossattention" in name and name.endswith("weight") and "LayerNorm" not in name:
                param.mul_(25.0)
    torch.manual_seed(3)
    head = torch.nn.Module()
    head.layers = aesthetic_head(HIDDEN)
    for layer in head.layers:  # weights large enough that image and prompt move the score visibly
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=0.5)
    state = _released_layout(model)
    state.update({"mlp." + k: v.clone() for k, v in head.state_dict().items()})
    torch.save(state, root / "ImageReward.pt")
    return root / "ImageReward.pt", blip, state


@pytest.fixture(scope="module")
def folder(released, tmp_path_factory):
    checkpoint, blip, _ = released
    return convert_checkpoint(checkpoint, blip, tmp_path_factory.mktemp("converted") / "image_reward")


def test_the_converter_puts_every_released_tensor_where_transformers_reads_it(released, folder):
    from transformers import BlipForImageTextRetrieval

    _, _, state = released
    model = BlipForImageTextRetrieval.from_pretrained(folder).state_dict()
    assert torch.equal(model["vision_model.encoder.layers.1.self_attn.qkv.weight"],
                       state["blip.visual_encoder.blocks.1.attn.qkv.weight"])
    assert torch.equal(model["vision_model.post_layernorm.bias"], state["blip.visual_encoder.norm.bias"])
    assert torch.equal(model["vision_model.embeddings.class_embedding"], state["blip.visual_encoder.cls_token"])
    assert torch.equal(model["text_encoder.encoder.layer.0.crossattention.self.key.weight"],
                       state["blip.text_encoder.encoder.layer.0.crossattention.self.key.weight"])
    matched = sum(torch.equal(model[k.replace("blip.", "", 1)], v) for k, v in state.items() if k.startswith("blip.text"))
    assert matched == sum(k.startswith("blip.text") for k in state)
    head = load_file(str(folder / "head.safetensors"))
    assert head.keys() == {k[len("mlp."):] for k in state if k.startswith("mlp.")}
    assert all(torch.equal(head[k], state["mlp." + k]) for k in head)


def _with_head(folder, copy, set_head):
    """A copy of the converted folder whose head starts at all zeros and is then set by `set_head`."""
    import shutil

    shutil.copytree(folder, copy)
    layers = aesthetic_head(HIDDEN)
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.zero_()
                layer.bias.zero_()
        set_head(layers)
    save_file({f"layers.{k}": v.contiguous() for k, v in layers.state_dict().items()}, str(copy / "head.safetensors"))
    return copy


def test_the_score_is_blips_own_image_text_feature_through_the_head(folder, tmp_path):
    """A head that copies BLIP's image-text-matching logit ("match") through its linear layers
    turns the reward into (that logit - MEAN) / STD: the reward's [CLS] feature is exactly the
    one transformers' ITM head reads (same tokens, padding, image tokens, cross-attention)."""
    from transformers import BlipForImageTextRetrieval, BlipProcessor

    model = BlipForImageTextRetrieval.from_pretrained(folder).eval()

    def copy_match_logit(layers):
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight[0, 0] = 1.0  # unit 0 carries the value through
        layers[0].weight[0] = model.itm_head.weight[1]
        layers[0].bias[0] = model.itm_head.bias[1]

    copy = _with_head(folder, tmp_path / "itm", copy_match_logit)
    batch = images()
    processor = BlipProcessor.from_pretrained(copy)
    with torch.no_grad():
        inputs = processor(images=list(batch.numpy()), text=PROMPTS, padding="max_length", max_length=35,
                           truncation=True, return_tensors="pt")
        match_logit = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                            pixel_values=inputs["pixel_values"], use_itm_head=True).itm_score[:, 1]
    scores = get_reward("image_reward", path=str(copy))(batch, PROMPTS, [{}] * 5)["image_reward"]
    torch.testing.assert_close(scores, (match_logit - MEAN) / STD, rtol=1e-5, atol=1e-5)


def test_standardisation_constants_by_hand(folder, tmp_path):
    """A head that outputs MEAN + 2 STD for every input scores exactly 2."""
    copy = _with_head(folder, tmp_path / "const", lambda layers: layers[-1].bias.fill_(MEAN + 2 * STD))
    scores = get_reward("image_reward", path=str(copy))(images(3), PROMPTS[:3], [{}] * 3)["image_reward"]
    torch.testing.assert_close(scores, torch.full((3,), 2.0), rtol=0, atol=1e-6)


def test_scores_are_deterministic_batch_invariant_and_read_prompt_and_image(folder):
    batch = images(seed=1)
    whole = get_reward("image_reward", path=str(folder))(batch, PROMPTS, [{}] * 5)["image_reward"]
    pieces = get_reward("image_reward", path=str(folder), batch_size=2)(batch, PROMPTS, [{}] * 5)["image_reward"]
    again = get_reward("image_reward", path=str(folder))(batch, PROMPTS, [{}] * 5)["image_reward"]
    assert whole.shape == (5,) and whole.dtype == torch.float32
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-6)
    assert torch.equal(again, whole)
    swapped = get_reward("image_reward", path=str(folder))(batch, PROMPTS[::-1], [{}] * 5)["image_reward"]
    # random-noise images all look alike to a random ViT: compare flat images of two colours
    dark, bright = (torch.full((5, 40, 40, 3), v, dtype=torch.uint8) for v in (0, 255))
    dark_scores, bright_scores = (get_reward("image_reward", path=str(folder))(x, PROMPTS, [{}] * 5)["image_reward"]
                                  for x in (dark, bright))
    assert (swapped - whole).abs().min() > 1e-3 or (swapped - whole).abs().max() > 1e-1
    assert (dark_scores - bright_scores).abs().min() > 1e-2


def test_bad_checkpoints_and_folders_are_named(released, folder, tmp_path):
    checkpoint, blip, state = released
    with pytest.raises(ConfigError, match=r"options.path.*lacks \['head.safetensors'\]"):
        get_reward("image_reward", path=str(blip))
    pickled = tmp_path / "pickled.pt"
    torch.save({"model": torch.nn.Linear(2, 2)}, pickled)  # a pickled module, not tensors: never unpickled
    with pytest.raises(ModelFolderError, match="not readable as tensors only"):
        convert_checkpoint(pickled, blip, tmp_path / "out1")
    partial = tmp_path / "partial.pt"
    torch.save({k: v for k, v in state.items() if "layer.1.output" not in k}, partial)
    with pytest.raises(ModelFolderError, match="lacks 4 tensors of the model"):
        convert_checkpoint(partial, blip, tmp_path / "out2")
    foreign = tmp_path / "foreign.pt"
    torch.save({**state, "unet.conv_in.weight": torch.zeros(1)}, foreign)
    with pytest.raises(ModelFolderError, match="unexpected tensors"):
        convert_checkpoint(foreign, blip, tmp_path / "out3")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_the_command_line_converts_and_the_folder_trains_as_a_reward(released, tmp_path):
    from pixelrl.cli import main
    from pixelrl.config import load_config

    checkpoint, blip, _ = released
    out = tmp_path / "ir"
    assert main(["convert-reward", "image_reward", str(checkpoint), str(out), "--base", str(blip)]) == 0
    cfg = load_config("shapes_flow_grpo", [f"reward.functions=[{{name: image_reward, options: {{path: {out}}}}}]"])
    assert cfg.reward.functions[0]["options"]["path"] == str(out)
    assert main(["convert-reward", "image_reward", str(checkpoint), str(out), "--base", str(blip)]) == 2  # no overwrite
