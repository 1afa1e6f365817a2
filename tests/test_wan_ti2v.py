"""Wan 2.2 TI2V-5B folders (`expand_timesteps` in model_index.json) as text-to-video: its residual
VAE's 4x-wider latent cells (sampling and adapters equal to WanPipeline's on such a folder are in
tests/test_families.py, case `wan_ti2v`)."""

import json

import pytest
import torch

from pixelrl.core.errors import ConfigError


def test_ti2v_videos_decode_and_encode_through_its_residual_vae(tiny_wan_ti2v_path):
    """The Wan 2.2 VAE folds 2 x 2 pixels before its own downsampling: a latent cell is 4 pixels
    wide here (16 in TI2V-5B), so sizes must be multiples of 8 (cell x the 2 x 2 patch) and 36 is
    refused where the Wan 2.1 folder (2-pixel cells) takes it."""
    from pixelrl.models.wan import WanModel

    assert json.loads((tiny_wan_ti2v_path / "model_index.json").read_text())["expand_timesteps"]
    model = WanModel(tiny_wan_ti2v_path, max_sequence_length=16, num_frames=5)
    assert model.latent_shape(32, 32) == (4, 3, 8, 8)
    assert WanModel.latent_unit(tiny_wan_ti2v_path) == 8
    videos = model.decode(torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    assert videos.shape == (2, 5, 32, 32, 3) and videos.dtype == torch.uint8
    assert model.encode(videos).shape == (2, 4, 3, 8, 8)
    with pytest.raises(ConfigError, match="rollout.resolution.*multiples of 8"):
        model.latent_shape(36, 36)
