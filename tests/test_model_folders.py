"""A damaged model folder: one ModelFolderError naming the part and the fix, from the loader, from
`pixelrl train` on a local worker and from a Ray worker (no library traceback), never a run that
trains on unusable weights."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch as st

from pixelrl.core.errors import ModelFolderError


def _weights(folder, part):
    return next((folder / part).glob("*.safetensors"))


def _truncate(folder, part):
    path = _weights(folder, part)
    path.write_bytes(path.read_bytes()[:1000])


def _nan_first_tensor(folder, part):
    path = _weights(folder, part)
    tensors = st.load_file(path)
    first = sorted(tensors)[0]
    tensors[first][...] = float("nan")
    st.save_file(tensors, path)


DAMAGE = {
    # what is wrong: (how to make it, the text the error must hold)
    "transformer weights missing": (lambda f: _weights(f, "transformer").unlink(), "cannot load `transformer/`"),
    "transformer weights truncated": (lambda f: _truncate(f, "transformer"), "cannot load `transformer/`"),
    "safetensors header corrupted": (
        lambda f: _weights(f, "transformer").write_bytes(b"\xff" * 8 + _weights(f, "transformer").read_bytes()[8:]),
        "cannot load `transformer/`"),
    "transformer config not JSON": (lambda f: (f / "transformer" / "config.json").write_text("{oops"),
                                    "cannot load `transformer/`"),
    "text encoder weights missing": (lambda f: _weights(f, "text_encoder_2").unlink(), "cannot load `text_encoder_2/`"),
    "tokenizer folder missing": (lambda f: shutil.rmtree(f / "tokenizer"), "cannot load `tokenizer/`"),
    "tokenizer vocabulary missing": (lambda f: (f / "tokenizer" / "tokenizer.json").unlink(), "has no vocabulary"),
    "transformer weights NaN": (lambda f: _nan_first_tensor(f, "transformer"), "NaN or inf weights"),
    "text encoder weights NaN": (lambda f: _nan_first_tensor(f, "text_encoder"), "NaN or inf weights"),
    "empty VAE weights": (lambda f: _weights(f, "vae").write_bytes(b""), "cannot load `vae/`"),
    "only a .bin (pickle) transformer": (
        lambda f: _weights(f, "transformer").rename(f / "transformer" / "diffusion_pytorch_model.bin"),
        "cannot load `transformer/`"),
}


@pytest.fixture
def damaged(tiny_sd3_path, tmp_path):
    def make(what):
        folder = tmp_path / "model"
        shutil.copytree(tiny_sd3_path, folder)
        DAMAGE[what][0](folder)
        return folder

    return make


@pytest.mark.parametrize("what", list(DAMAGE))
def test_a_damaged_model_folder_is_one_clear_error(damaged, what):
    from pixelrl.models import load_model

    folder = damaged(what)
    with pytest.raises(ModelFolderError) as caught:
        load_model("sd3", str(folder), max_sequence_length=0)
    message = str(caught.value)
    assert str(folder) in message and DAMAGE[what][1] in message, message
    assert "copy" in message  # the fix


def test_the_intact_folder_loads(tiny_sd3_path):
    from pixelrl.models import load_model

    assert load_model("sd3", str(tiny_sd3_path), max_sequence_length=0).transformer is not None


def test_train_on_a_damaged_folder_exits_with_the_message_and_writes_no_checkpoint(damaged, tmp_path, capsys):
    from conftest import train_cli

    folder = damaged("transformer weights NaN")
    code, run_dir = train_cli(tmp_path / "out", folder, "trainer.backend=local")
    printed = capsys.readouterr()
    assert code == 2 and "NaN or inf weights" in printed.err and "Traceback" not in printed.err + printed.out
    assert not (run_dir / "checkpoints").exists()


def test_a_ray_worker_reports_the_damaged_folder_by_rank(ray_cluster, damaged, tmp_path, capsys):
    from conftest import train_cli

    folder = damaged("tokenizer vocabulary missing")
    code, _ = train_cli(tmp_path / "out", folder, "trainer.backend=ray")
    printed = capsys.readouterr()
    assert code == 2 and "Traceback" not in printed.err
    assert "actor worker rank 0: model folder" in printed.err and "has no vocabulary" in printed.err
