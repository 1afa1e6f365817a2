"""Every shipped recipe's evidence level (config/evidence.py): each recipe has one, every test it
names exists and names the recipe, every doc section it names exists and names it, the table in
docs/algorithms/paper_settings.md is the registry's, and train and plan print it. The recipes
whose only end-to-end evidence is here train through `pixelrl train` and resume."""

import ast
import re
from pathlib import Path

import pytest

from pixelrl.config.evidence import LEVELS, RECIPES, evidence_line, evidence_table

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "src" / "pixelrl" / "configs").glob("*.yaml"))


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _section(page: Path, anchor: str) -> str | None:
    """The text under the heading with this anchor, to the next heading of its level or above."""
    lines, out, depth = page.read_text().splitlines(), None, 0
    for line in lines:
        heading = re.match(r"(#+) (.*)", line)
        if heading and out is not None and len(heading.group(1)) <= depth:
            break
        if heading and out is None and _slug(heading.group(2)) == anchor:
            out, depth = [], len(heading.group(1))
        elif out is not None:
            out.append(line)
    return None if out is None else "\n".join(out)


def _names(text: str, recipe: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(recipe)}(?![\w])", text) is not None


def test_every_shipped_recipe_has_exactly_one_level():
    assert sorted(RECIPES) == CONFIGS
    assert {entry.level for entry in RECIPES.values()} <= set(LEVELS)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_evidence_named_exists_and_names_the_recipe(recipe):
    entry = RECIPES[recipe]
    assert entry.where, recipe
    for where in entry.where:
        if "::" in where:
            file, test = where.split("::")
            source = (ROOT / file).read_text()
            functions = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
            assert test in functions, where
            assert _names(source, recipe), f"{file} never names {recipe}"
        else:
            page, _, anchor = where.partition("#")
            section = _section(ROOT / page, anchor)
            assert section is not None, f"{where}: no such heading"
            assert _names(section, recipe), f"{where} never names {recipe}"
    if entry.level in ("proxy-gated", "measured"):  # a claim about learning cites a measurement, not a test
        assert any(w.startswith("docs/") for w in entry.where), recipe
    if entry.level == "real-size":
        assert any(w.startswith("docs/benchmarks.md") for w in entry.where), recipe


def test_the_docs_table_is_the_registrys():
    page = (ROOT / "docs" / "algorithms" / "paper_settings.md").read_text()
    assert evidence_table() in page, "regenerate it: python -c 'from pixelrl.config.evidence import " \
                                     "evidence_table; print(evidence_table())'"


def test_plan_prints_the_level_and_a_users_own_file_has_none(tmp_path):
    from conftest import paper_config
    from pixelrl.config.plan import describe, plan_for

    assert evidence_line("shapes_demo").startswith("evidence: proxy-gated (learns on the shapes world")
    assert evidence_line(str(tmp_path / "mine.yaml")) is None and evidence_line(None) is None
    cfg = paper_config("flow_grpo_sd35")
    lines = describe(cfg, plan_for(cfg, 1, 80), "flow_grpo_sd35").splitlines()
    assert lines[1].startswith("evidence: real-size (ran at the real model's size on a GPU")
    assert not any(line.startswith("evidence:") for line in describe(cfg, plan_for(cfg, 1, 80)).splitlines())


@pytest.mark.parametrize("config, loss_key", [("awm_tiny", "actor/policy_loss"), ("dgpo_tiny", "actor/policy_loss"),
                                              ("flow_grpo_wan_tiny", "actor/pg_loss")])
def test_the_recipes_no_other_test_trains_train_end_to_end_and_resume(config, loss_key, tmp_path, tiny_pixel_path,
                                                                       tiny_wan_path, capsys):
    import math

    from conftest import read_metrics
    from pixelrl.cli import main

    model = tiny_wan_path if "wan" in config else tiny_pixel_path
    common = ["--config-name", config, f"model.path={model}", f"trainer.default_local_dir={tmp_path}",
              "trainer.backend=local", "trainer.logger=[jsonl]", "trainer.num_cpus_per_worker=1", "trainer.save_freq=2"]
    assert main(["train", *common, "trainer.total_training_steps=2"]) == 0
    assert f"evidence: {RECIPES[config].level}" in capsys.readouterr().out
    assert main(["train", *common, "trainer.total_training_steps=3"]) == 0  # resumes from step 2
    rows = read_metrics(tmp_path / "pixelrl" / config)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r[loss_key]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
