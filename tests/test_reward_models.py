"""Model-based rewards on tiny random CLIP models written offline: CLIP score and PickScore
against transformers' own logits, the aesthetic head, batching, and bad folders."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pixelrl.core.errors import ConfigError, ModelFolderError
from pixelrl.testing import build_tiny_clip
from pixelrl.rewards import get_reward
from pixelrl.rewards.clip import aesthetic_head

PROMPTS = ["a red circle", "two blue squares", "a cat on a house", "a green tree", "a flower"]


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


def images(batch=5, size=40, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))


@pytest.mark.parametrize("name, divisor", [("clip_score", 30.0), ("pickscore", 26.0)])
def test_similarity_rewards_equal_clips_own_logits(clip_path, name, divisor):
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(clip_path).eval(), CLIPProcessor.from_pretrained(clip_path)
    batch = images()
    with torch.no_grad():
        inputs = processor(text=PROMPTS, images=list(batch.numpy()), padding=True, return_tensors="pt")
        expected = model(**inputs).logits_per_image.diagonal() / divisor
    scores = get_reward(name, path=str(clip_path))(batch, PROMPTS, [{}] * 5)[name]
    assert scores.shape == (5,)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


def test_scores_are_deterministic_and_independent_of_the_batching(clip_path):
    batch = images(seed=1)
    whole = get_reward("clip_score", path=str(clip_path), batch_size=32)(batch, PROMPTS, [{}] * 5)["clip_score"]
    pieces = get_reward("clip_score", path=str(clip_path), batch_size=2)(batch, PROMPTS, [{}] * 5)["clip_score"]
    again = get_reward("clip_score", path=str(clip_path), batch_size=32)(batch, PROMPTS, [{}] * 5)["clip_score"]
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-6)
    assert torch.equal(again, whole)
    # the score depends on the prompt paired with each image
    swapped = get_reward("clip_score", path=str(clip_path))(batch, PROMPTS[::-1], [{}] * 5)["clip_score"]
    assert not torch.allclose(swapped, whole)


def _aesthetic_folder(root, clip_path, bias: float):
    import shutil

    shutil.copytree(clip_path, root / "clip")
    torch.manual_seed(0)
    head = torch.nn.Module()
    head.layers = aesthetic_head(16)
    with torch.no_grad():
        head.layers[-1].bias.fill_(bias)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(root / "head.safetensors"))
    return root


def test_aesthetic_applies_the_head_to_normalised_image_embeddings(tmp_path, clip_path):
    low = _aesthetic_folder(tmp_path / "low", clip_path, bias=0.0)
    high = _aesthetic_folder(tmp_path / "high", clip_path, bias=5.0)
    batch = images(seed=2)
    a = get_reward("aesthetic", path=str(low))(batch, PROMPTS, [{}] * 5)["aesthetic"]
    b = get_reward("aesthetic", path=str(high), batch_size=2)(batch, PROMPTS, [{}] * 5)["aesthetic"]
    assert a.shape == (5,) and len(set(a.tolist())) == 5      # one score per image, from the image
    torch.testing.assert_close(b - a, torch.full((5,), 5.0), rtol=0, atol=1e-5)  # the head's last bias adds
    # the embedding is normalised: a CLIP whose projection is 10x larger scores the same
    from transformers import CLIPModel

    scaled = _aesthetic_folder(tmp_path / "scaled", clip_path, bias=0.0)
    model = CLIPModel.from_pretrained(scaled / "clip")
    with torch.no_grad():
        model.visual_projection.weight.mul_(10.0)
    model.save_pretrained(scaled / "clip")
    c = get_reward("aesthetic", path=str(scaled))(batch, PROMPTS, [{}] * 5)["aesthetic"]
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


def test_bad_folders_are_named(tmp_path, clip_path):
    with pytest.raises(ConfigError, match="options.path"):
        get_reward("clip_score")
    with pytest.raises(ConfigError, match=r"options.path.*lacks \['config.json'\]"):
        get_reward("pickscore", path=str(tmp_path))
    folder = tmp_path / "aes"
    folder.mkdir()
    with pytest.raises(ConfigError, match="lacks.*head.safetensors"):
        get_reward("aesthetic", path=str(folder))
    damaged = _aesthetic_folder(tmp_path / "damaged", clip_path, bias=0.0)
    (damaged / "head.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelFolderError, match="head.safetensors"):
        get_reward("aesthetic", path=str(damaged))(images(1), ["x"], [{}])


def test_clip_source_similarity_is_the_cosine_of_the_edit_and_its_source(clip_path):
    """cos(CLIP image embedding of the edit, of its source) from transformers' own model: 1 for an
    untouched source; a source decoded at another size is resized to the edit's first."""
    from transformers import CLIPModel, CLIPProcessor

    from pixelrl.rewards.source import first_sources

    model, processor = CLIPModel.from_pretrained(clip_path).eval(), CLIPProcessor.from_pretrained(clip_path)
    edits, sources = images(seed=3), images(seed=4)

    def embed(batch):
        with torch.no_grad():
            out = model.get_image_features(**processor(images=list(batch.numpy()), return_tensors="pt"))
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return out / out.norm(dim=-1, keepdim=True)

    reward = get_reward("clip_source_similarity", path=str(clip_path))
    scores = reward(edits, PROMPTS, [{}] * 5, condition_images=[(s,) for s in sources])["clip_source_similarity"]
    torch.testing.assert_close(scores, (embed(edits) * embed(sources)).sum(-1), rtol=1e-5, atol=1e-6)
    same = reward(sources, PROMPTS, [{}] * 5, condition_images=[(s,) for s in sources])["clip_source_similarity"]
    torch.testing.assert_close(same, torch.ones(5), rtol=1e-5, atol=1e-5)
    large = torch.nn.functional.interpolate(sources.permute(0, 3, 1, 2).float(), scale_factor=2, mode="nearest")
    large = large.to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(first_sources([(s,) for s in large], (40, 40)), sources)  # 2 x 2 blocks average back
    resized = reward(edits, PROMPTS, [{}] * 5, condition_images=[(s,) for s in large])["clip_source_similarity"]
    torch.testing.assert_close(resized, scores, rtol=1e-5, atol=1e-6)
    # in a weighted sum, samples without sources are refused by the reward's name
    from pixelrl.core.errors import RewardError
    from pixelrl.rewards import WeightedReward

    weighted = WeightedReward.from_functions([{"name": "clip_source_similarity", "options": {"path": str(clip_path)}}])
    with pytest.raises(RewardError, match="clip_source_similarity"):
        weighted(edits, PROMPTS, [{}] * 5)
