"""HPSv2 on a tiny random CLIP written offline: the converter reads OpenCLIP's checkpoint layout
(packed q/k/v, x @ proj projections) into transformers' CLIP, and the score is the cosine of
transformers' own embeddings."""

import numpy as np
import pytest
import torch

from pixelrl.core.errors import ModelFolderError
from pixelrl.testing import build_tiny_clip
from pixelrl.rewards import get_reward
from pixelrl.rewards.hps import convert_checkpoint

PROMPTS = ["a red circle", "two blue squares", "a cat on a house", "a green tree", "a flower"]


def images(batch=5, size=40, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))


def _open_clip_layout(model) -> dict[str, torch.Tensor]:
    """A transformers CLIPModel's tensors under OpenCLIP's names, written out by hand from its
    module layout: packed attention input projection, projections applied as x @ proj."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    out = {"visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
           "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
           "visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
           "visual.proj": sd["visual_projection.weight"].t().contiguous(),
           "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
           "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
           "text_projection": sd["text_projection.weight"].t().contiguous(),
           "logit_scale": sd["logit_scale"], "attn_mask": torch.zeros(4, 4)}
    for ours, theirs in (("vision_model.pre_layrnorm", "visual.ln_pre"), ("vision_model.post_layernorm", "visual.ln_post"),
                         ("text_model.final_layer_norm", "ln_final")):
        for p in ("weight", "bias"):
            out[f"{theirs}.{p}"] = sd[f"{ours}.{p}"]
    for tower, prefix in (("vision_model", "visual.transformer"), ("text_model", "transformer")):
        for i in range(model.config.vision_config.num_hidden_layers):
            src, dst = f"{tower}.encoder.layers.{i}", f"{prefix}.resblocks.{i}"
            for p in ("weight", "bias"):
                out[f"{dst}.attn.in_proj_{p}"] = torch.cat([sd[f"{src}.self_attn.{n}_proj.{p}"] for n in "qkv"])
                for ours, theirs in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                                     ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                    out[f"{dst}.{theirs}.{p}"] = sd[f"{src}.{ours}.{p}"]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import CLIPModel

    root = tmp_path_factory.mktemp("hps")
    base = build_tiny_clip(root / "base", seed=0)
    tuned = build_tiny_clip(root / "tuned", seed=5)  # the "fine-tuned" weights differ from the base's
    model = CLIPModel.from_pretrained(tuned)
    torch.save({"state_dict": {"module." + k: v for k, v in _open_clip_layout(model).items()}}, root / "HPS.pt")
    return convert_checkpoint(root / "HPS.pt", base, root / "hpsv2"), tuned, root


def test_the_converted_model_is_the_checkpoints_model(converted):
    from transformers import CLIPModel

    folder, tuned, _ = converted
    ours, theirs = CLIPModel.from_pretrained(folder).state_dict(), CLIPModel.from_pretrained(tuned).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_score_is_the_cosine_of_clips_embeddings(converted):
    from transformers import CLIPModel, CLIPProcessor

    folder, _, _ = converted
    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    batch = images()
    with torch.no_grad():
        inputs = processor(text=PROMPTS, images=list(batch.numpy()), padding=True, return_tensors="pt")
        cosine = model(**inputs).logits_per_image.diagonal() / model.logit_scale.exp()
    scores = get_reward("hpsv2", path=str(folder))(batch, PROMPTS, [{}] * 5)["hpsv2"]
    torch.testing.assert_close(scores, cosine, rtol=1e-5, atol=1e-6)
    assert scores.abs().max() <= 1.0
    pieces = get_reward("hpsv2", path=str(folder), batch_size=2)(batch, PROMPTS, [{}] * 5)["hpsv2"]
    torch.testing.assert_close(pieces, scores, rtol=1e-5, atol=1e-6)


def test_foreign_or_incomplete_checkpoints_are_refused(converted, tmp_path):
    folder, tuned, root = converted
    state = torch.load(root / "HPS.pt", weights_only=True)["state_dict"]
    partial = tmp_path / "partial.pt"
    torch.save({k: v for k, v in state.items() if "ln_final" not in k}, partial)
    with pytest.raises(ModelFolderError, match="lacks 2 tensors"):
        convert_checkpoint(partial, tuned, tmp_path / "a")
    foreign = tmp_path / "foreign.pt"
    torch.save({**state, "unet.conv_in.weight": torch.zeros(1)}, foreign)
    with pytest.raises(ModelFolderError, match="unexpected tensors"):
        convert_checkpoint(foreign, tuned, tmp_path / "b")
    wider = build_tiny_clip(tmp_path / "wider", hidden=48)
    with pytest.raises(ModelFolderError, match="does not fit the checkpoint"):
        convert_checkpoint(root / "HPS.pt", wider, tmp_path / "c")
