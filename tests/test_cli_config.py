"""`pixelrl config` prints the resolved config and checks it; a misspelt key names its value and
the key it was probably meant to be."""

import pytest

from pixelrl.core.errors import ConfigError


def test_pixelrl_config_prints_the_merged_config_and_checks_it(tmp_path, capsys):
    from omegaconf import OmegaConf

    from pixelrl.cli import main

    overrides = ["actor.lr=0.002", f"trainer.default_local_dir={tmp_path}"]
    assert main(["config", "--config-name", "shapes_flow_grpo", *overrides]) == 0
    out = capsys.readouterr().out
    printed = OmegaConf.create(out)  # the YAML, the verdict a comment
    assert printed.actor.lr == 0.002 and printed.diffusion_loss.name == "flow_grpo"
    assert printed.rollout.resolution == 32  # from the config chain (the schema says 512)
    assert "# valid on this machine: pixelrl train --config-name shapes_flow_grpo actor.lr=0.002" in out
    assert not (tmp_path / "pixelrl").exists()  # nothing started, nothing written
    assert main(["config", "--config-name", "shapes_flow_grpo", "rollout.n=0"]) == 2
    captured = capsys.readouterr()
    assert "rollout.n" in captured.err + captured.out and "# valid" not in captured.out


def test_a_recipe_of_ones_own_extends_a_bundled_config_or_a_file_beside_it(tmp_path):
    """`defaults:` in a YAML file names a file next to it, else a bundled config (it was looked
    for only next to the file, so `defaults: [flow_grpo_sd35]` in a user's recipe failed)."""
    from pixelrl.config import load_config

    (tmp_path / "mine.yaml").write_text("defaults: [shapes_flow_grpo]\nrollout:\n  n: 2\n")
    (tmp_path / "shared.yaml").write_text("actor:\n  lr: 0.002\n")
    (tmp_path / "two.yaml").write_text("defaults: [mine, shared]\n")  # later entries win
    cfg = load_config(str(tmp_path / "two.yaml"), [f"trainer.default_local_dir={tmp_path}"])
    assert (cfg.rollout.n, cfg.actor.lr, cfg.rollout.resolution, cfg.diffusion_loss.name) == (2, 0.002, 32, "flow_grpo")


@pytest.mark.parametrize("override, suggestion, value", [("actor.lrr=1e-4", "lr", 1e-4),
                                                         ("rollout.num_step=4", "num_steps", 4),
                                                         ("trainer.total_training_step=3", "total_training_steps", 3)])
def test_a_misspelt_key_names_its_value_and_the_likely_key(override, suggestion, value):
    from pixelrl.config import load_config

    with pytest.raises(ConfigError, match=rf"did you mean `{suggestion}`\?") as err:
        load_config("shapes_flow_grpo", [override])
    assert err.value.value == value  # was shown as None


def test_a_key_far_from_any_suggests_nothing():
    from pixelrl.config import load_config

    with pytest.raises(ConfigError, match="unknown key; known keys here") as err:
        load_config("shapes_flow_grpo", ["actor.zzzzz=1"])
    assert "did you mean" not in str(err.value)


def test_every_command_says_what_it_does_and_every_option_its_meaning_and_default(capsys):
    """`pixelrl <command> --help` opens with a description; every argument has help; an option's
    default is shown where it has one; `train --help` lists the shipped configs."""
    import argparse

    import pytest

    from pixelrl.cli import describe_commands, main, rewards, shapes, training, vlm

    parser = argparse.ArgumentParser(prog="pixelrl")
    sub = parser.add_subparsers(dest="command")
    for commands in (training, shapes, vlm, rewards):
        commands.add_parsers(sub)
    describe_commands(sub)
    for name, command in sub.choices.items():
        assert command.description, name
        undocumented = [a.dest for a in command._actions if not a.help]
        assert not undocumented, (name, undocumented)
    for argv, expected in ((["generate", "--help"], "the first sampling seed (default: 0)"),
                           (["train", "--help"], "dmd2_sd35"), (["plan", "--help"], "(default: 989.0)")):
        with pytest.raises(SystemExit):
            main(argv)
        shown = " ".join(capsys.readouterr().out.split())
        assert expected in shown, (argv, shown)
    assert "--task" not in " ".join(sub.choices["generate"].format_help().split())  # eval has it, generate not
