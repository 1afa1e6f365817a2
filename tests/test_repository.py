"""The repository keeps its promises to a new user: every path the README names exists, every
config field is read by some code, and every declared dependency is imported somewhere."""

import dataclasses
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pixelrl"


def test_every_path_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"\]\(([^)#]+)\)", text))  # markdown links
    paths |= set(re.findall(r"`((?:configs|docs|src|benchmarks|tests)/[^`\s]+)`", text))
    assert paths, "the README names no path at all?"
    missing = sorted(p for p in paths if not p.startswith("http") and not (ROOT / p).exists())
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_between_the_docs_resolves():
    """A relative link in the README or docs/ names a file that exists and, with `#anchor` into
    a markdown page, a heading that page has (moving or condensing a page breaks no link)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^(https?:|mailto:)", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _leaf_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _leaf_fields(type(default), f"{prefix}{f.name}.")
        elif kind is None or not dataclasses.is_dataclass(kind):
            yield f"{prefix}{f.name}", f.name


def test_every_config_field_is_read_by_some_code():
    from pixelrl.config.sections import PixelRLConfig

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


# Each package may import only the packages listed before it (function-level imports count).
# `config` composes and checks the sections, so it sits above everything whose options it checks;
# `shapes`, `demo` and `cli` are the top: nothing but the CLI imports them.
LAYERS = ["core", "parallel", "models", "sampling", "algos", "rewards", "data", "engine", "config", "workers", "trainers",
          "vlm", "shapes", "testing", "cli", "__main__"]


def _package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where, for every `import pixelrl.X` / `from pixelrl.X`."""
    import ast

    edges: dict[tuple[str, str], list[str]] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).parts
        package = parts[0] if len(parts) > 1 else parts[0][:-3]
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for name in names:
                bits = name.split(".")
                if bits[0] == "pixelrl" and len(bits) > 1 and bits[1] != package:
                    edges.setdefault((package, bits[1]), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return edges


def test_packages_import_only_the_layers_below_them():
    edges = _package_imports()
    # the package root, imported first by every process, only declares the extensions to core
    assert {b for (a, b) in edges if a == "__init__"} == {"core"}, edges
    edges = {k: v for k, v in edges.items() if k[0] != "__init__"}
    packages = {a for a, _ in edges} | {b for _, b in edges}
    assert packages <= set(LAYERS), f"packages missing from LAYERS: {sorted(packages - set(LAYERS))}"
    upward = {f"{a} -> {b}": where for (a, b), where in edges.items() if LAYERS.index(b) > LAYERS.index(a)}
    assert not upward, upward
    assert not [b for (a, b) in edges if a == "core"], "core is the ground: it imports no other pixelrl package"
    cycles = sorted({tuple(sorted((a, b))) for (a, b) in edges if (b, a) in edges})
    assert not cycles, cycles


def test_no_package_names_a_higher_one_in_its_code():
    """A module path in a string (an `importlib.import_module` argument, a registry's lazy entry)
    is a dependency the import scan cannot see: no package may name a higher layer's module that
    way (docstrings and messages aside: only strings that are a whole dotted module path count)."""
    import ast

    found = []
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).parts
        package = parts[0] if len(parts) > 1 else parts[0][:-3]
        if package not in LAYERS:
            continue
        tree = ast.parse(path.read_text())  # one tree: the docstrings are known by node identity
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                match = re.fullmatch(r"pixelrl\.([a-z_]+)(\.[a-z_.]+)?", node.value)
                if match and match.group(1) in LAYERS and LAYERS.index(match.group(1)) > LAYERS.index(package):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not found, found


def test_the_readme_gpu_command_trains_on_a_real_reward_and_says_so():
    """The README's SD3.5 command composes, and it names a reward model, not the config's
    placeholder (JPEG compressibility); the plan's `reward:` line names what the run trains on."""
    import re
    import shlex

    from pixelrl.config.plan import reward_names
    from pixelrl.config.validation import compose_config

    text = (ROOT / "README.md").read_text()
    block = re.search(r"pixelrl train --config-name flow_grpo_sd35 (.*?)\n    pixelrl export", text, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    cfg = compose_config("flow_grpo_sd35", argv)
    assert [spec["name"] for spec in cfg.reward.functions] == ["pickscore"]
    assert reward_names(cfg) == "pickscore (weight 1)"
