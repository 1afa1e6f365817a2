"""`pixelrl generate` and `eval` sample as the model or the run does unless told otherwise, and say so."""

from argparse import Namespace

import pytest
from PIL import Image

from pixelrl.core.errors import ConfigError



class NoFolder:
    """A model whose folder is not on this machine: the side checks (which read its config files)
    have nothing to read."""
    path = "/no/such/model/folder"

def test_generate_samples_at_the_models_own_size(tmp_path, capsys):
    """A 64-px folder gives 64-px images (generate always sampled at 32 before); --resolution wins."""
    from pixelrl.cli import main
    from pixelrl.models import build_tiny_sd3

    folder = build_tiny_sd3(tmp_path / "tiny64", resolution=64, with_vae=False, with_t5=False)
    out = tmp_path / "grid.png"
    assert main(["generate", "--model", str(folder), "--prompt", "a red circle", "--n", "2", "--out", str(out)]) == 0
    assert "sampling at 64 px, 10 steps, guidance 4 (the model folder's defaults)" in capsys.readouterr().out
    assert Image.open(out).size == (2 * 64 * 4, 64 * 4)  # two cells, each an image drawn 4x
    assert main(["generate", "--model", str(folder), "--prompt", "a red circle", "--n", "1", "--out", str(out),
                 "--resolution", "32", "--steps", "3"]) == 0
    assert "sampling at 32 px, 3 steps, guidance 4 (the model folder's defaults; --resolution, --steps as given)" \
        in capsys.readouterr().out
    assert Image.open(out).size == (32 * 4, 32 * 4)


def test_a_checkpoint_samples_as_its_run_validated(tmp_path, capsys):
    """With --checkpoint: the run's rollout.resolution, val_kwargs.num_steps, validation guidance
    (val_kwargs.guidance_scale, else the rollouts') and negative prompt, each flag overriding."""
    from pixelrl.cli.shapes import sampling_options
    from pixelrl.config.sections import PixelRLConfig
    from pixelrl.core.config_io import saved_yaml

    cfg = PixelRLConfig()
    cfg.rollout.resolution, cfg.rollout.guidance_scale, cfg.rollout.negative_prompt = 48, 3.0, "blurry"
    cfg.val_kwargs.num_steps = 7
    (tmp_path / "config.yaml").write_text(saved_yaml(cfg))
    args = Namespace(checkpoint=str(tmp_path), resolution=None, steps=None, cfg=None)
    assert sampling_options(args, NoFolder()) == {"resolution": 48, "num_steps": 7, "guidance_scale": 3.0,
                                                  "negative_prompt": "blurry", "sigma_schedule": "scheduler",
                                                  "sigma_shift": 0.0}
    assert "sampling at 48 px, 7 steps, guidance 3 (the checkpoint's run validated with)" in capsys.readouterr().out
    cfg.val_kwargs.guidance_scale = 1.0
    (tmp_path / "config.yaml").write_text(saved_yaml(cfg))
    assert sampling_options(args, NoFolder())["guidance_scale"] == 1.0
    args.cfg, args.resolution = 2.5, 32
    assert sampling_options(args, NoFolder()) == {"resolution": 32, "num_steps": 7, "guidance_scale": 2.5,
                                                  "negative_prompt": "blurry", "sigma_schedule": "scheduler",
                                                  "sigma_shift": 0.0}


def test_an_exported_folder_samples_as_its_sampler_file_says(tmp_path, capsys):
    """An export's pixelrl_sampler.json (a DMD2 student: 4 steps of the shifted grid, no guidance)
    sets generate's defaults; flags still win; a damaged file is one error naming it."""
    import json

    from pixelrl.cli.shapes import sampling_options
    from pixelrl.core.errors import ModelFolderError

    class Folder(NoFolder):
        def default_resolution(self):
            return 64

    (tmp_path / "pixelrl_sampler.json").write_text(json.dumps(
        {"num_steps": 4, "guidance_scale": 1.0, "sigma_schedule": "linspace_shift", "sigma_shift": 3,
         "negative_prompt": ""}))
    args = Namespace(checkpoint=None, model=str(tmp_path), resolution=None, steps=None, cfg=None)
    assert sampling_options(args, Folder()) == {"resolution": 64, "num_steps": 4, "guidance_scale": 1.0,
                                                "negative_prompt": "", "sigma_schedule": "linspace_shift",
                                                "sigma_shift": 3}
    assert "4 steps on the linspace_shift grid (shift 3), guidance 1 (the folder's pixelrl_sampler.json)" in \
        capsys.readouterr().out
    args.steps = 2
    assert sampling_options(args, Folder())["num_steps"] == 2
    (tmp_path / "pixelrl_sampler.json").write_text('{"resolution": 32}')  # the side trained at, not the pipeline's
    assert sampling_options(args, Folder())["resolution"] == 32
    for damaged, problem in (('{"num_steps": "four"}', "pixelrl_sampler.json"), ('{"resolution": 0}', "not an image side")):
        (tmp_path / "pixelrl_sampler.json").write_text(damaged)
        with pytest.raises(ModelFolderError, match=problem):
            sampling_options(args, Folder())


def test_a_family_without_a_default_size_asks_for_one():
    from pixelrl.cli.shapes import sampling_options

    class Video:
        def default_resolution(self):
            return None

    with pytest.raises(ConfigError, match="--resolution"):
        sampling_options(Namespace(checkpoint=None, resolution=None, steps=None, cfg=None), Video())


def test_a_baseline_sampled_otherwise_is_refused():
    """Paired gains against a baseline evaluated at guidance 4 while this one samples at 1 would
    report the guidance, not the training (what a user met with the demo's checkpoint)."""
    from pixelrl.cli.shapes import _check_baseline_sampling

    here = {"resolution": 32, "num_steps": 10, "guidance_scale": 1.0, "negative_prompt": ""}
    _check_baseline_sampling("base.json", {"num_steps": 10, "guidance_scale": 1.0}, here)  # an older file: no size
    with pytest.raises(ConfigError, match=r"guidance_scale = 4.0.*--cfg 4.0"):
        _check_baseline_sampling("base.json", {"num_steps": 10, "guidance_scale": 4.0, "resolution": 32}, here)
