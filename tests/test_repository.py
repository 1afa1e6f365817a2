"""The repository keeps its promises to a new user: every path the README names exists, every
config field is read by some code, and every declared dependency is imported somewhere."""

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pixelrl"


def test_every_path_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"\]\(([^)#]+)\)", text))  # markdown links
    paths |= set(re.findall(r"`((?:configs|docs|src|benchmarks|tests)/[^`\s]+)`", text))
    assert paths, "the README names no path at all?"
    missing = sorted(p for p in paths if not p.startswith("http") and not (ROOT / p).exists())
    assert not missing, missing


def _leaf_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _leaf_fields(type(default), f"{prefix}{f.name}.")
        elif kind is None or not dataclasses.is_dataclass(kind):
            yield f"{prefix}{f.name}", f.name


def test_every_config_field_is_read_by_some_code():
    from pixelrl.core.config import PixelRLConfig

    code = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "config.py")
    unread = [full for full, name in _leaf_fields(PixelRLConfig)
              if not re.search(rf"\.{name}\b|\"{name}\"|'{name}'", code)]
    assert not unread, f"config fields nothing reads: {unread}"


def test_every_declared_dependency_is_imported():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    import_names = {"pillow": "PIL", "pyarrow": "pyarrow", "tensorboard": "torch.utils.tensorboard"}
    code = "\n".join(p.read_text() for p in list(SRC.rglob("*.py")) + list((ROOT / "benchmarks").glob("*.py")))
    unused = []
    for dep in deps:
        name = re.split(r"[<>=!\[ ]", dep)[0].lower()
        module = import_names.get(name, name.replace("-", "_"))
        if not re.search(rf"^\s*(import|from)\s+{re.escape(module)}\b", code, re.M):
            unused.append(name)
    assert not unused, f"declared but never imported: {unused}"
