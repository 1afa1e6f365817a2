"""Plugins: the user's own modules (rewards, losses, advantage estimators, model families),
imported in every process of a run.

`plugins:` in a run config lists dotted module names (importable where the run starts: an
installed package or a folder on PYTHONPATH) or paths of `.py` files. The driver imports them
before it validates the config, so a reward registered by a plugin is a known reward name; every
worker (Ray or in-process, policy, rollout and reward workers) imports the same list before it
builds anything. File paths are made absolute at load so a worker started in another folder
finds them.

A plugin is code the user chose to run, like the training command itself. It is imported only
from the config a user hands to `pixelrl train` / `demo`, never from a saved checkpoint's config:
reading a checkpoint (resume checks, eval, export) never runs code it names.

Two parts of pixelrl itself extend the lower layers the same way: the embedded shapes world (its
detector reward, its QA task) and the VLM trainer (its trainer type, answer rewards, QA files).
No lower package imports them, and this module does not name them: the package root
(`pixelrl/__init__.py`, which every process of a run imports first) declares them with
`register_extensions`, and the entry points call `import_extensions`: the CLI before it parses a
command, the config loader before it reads a trainer type (`merge_config`, `from_yaml_text`), every
worker before it reads its config, and `import_plugins` before the user's list. A registry lookup
never imports anything.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

from pixelrl.core.errors import ConfigError


def resolve_plugins(entries, field: str = "plugins") -> list[str]:
    """Check the entries' form and make file paths absolute (before anything is imported)."""
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(field, entries, "a list of module names or .py file paths")
    resolved = []
    for i, entry in enumerate(entries):
        name = f"{field}[{i}]"
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(name, entry, "a dotted module name (my_project.rewards) or the path of a .py file")
        if entry.endswith(".py"):
            path = Path(entry).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(name, entry, f"no such file ({path}); give the path of a .py file that registers "
                                               "your rewards or losses, or an importable module name")
            resolved.append(str(path))
        elif all(part.isidentifier() for part in entry.split(".")):
            resolved.append(entry)
        else:
            raise ConfigError(name, entry, "neither a .py file path nor a dotted module name")
    return resolved


def _module_name_for(path: Path) -> str:
    # one module per file path, so importing the same file twice (driver, then an in-process
    # worker) registers its entries once
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"pixelrl_plugin_{path.stem}_{digest}"


def _where(err: BaseException, origin: str) -> str:
    """file:line of the innermost frame inside the plugin's own code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == origin]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _module_file(module: str) -> str:
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # a parent package that fails to import: no file to point at
        return ""
    return (spec.origin or "") if spec else ""


# modules of pixelrl itself imported like plugins, by name, so that no lower package depends on
# them (see the module docstring)
_extensions: list[str] = []


def register_extensions(*modules: str) -> None:
    for module in modules:
        if module not in _extensions:
            _extensions.append(module)


def import_extensions() -> None:
    """Import the declared extensions (idempotent: Python caches modules)."""
    for module in _extensions:
        importlib.import_module(module)


def import_plugins(entries, field: str = "plugins") -> list[str]:
    """Import every plugin (idempotent); the entries as resolved (file paths absolute). A missing
    module or a plugin that raises while importing is one ConfigError naming the entry, the
    cause and where in the plugin it arose."""
    resolved = resolve_plugins(entries, field)
    import_extensions()
    for i, entry in enumerate(resolved):
        name = f"{field}[{i}]"
        try:
            if entry.endswith(".py"):
                path = Path(entry)
                module_name = _module_name_for(path)
                if module_name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
            else:
                importlib.import_module(entry)
        except ModuleNotFoundError as err:
            if entry.endswith(".py") or not (err.name and entry.startswith(err.name)):
                raise ConfigError(name, entry, f"importing it failed: {err}") from None
            raise ConfigError(name, entry, f"no module named `{err.name}` in this Python; install the package, add "
                                           "its folder to PYTHONPATH, or give the path of a .py file") from None
        except ConfigError:
            raise
        except Exception as err:
            origin = entry if entry.endswith(".py") else _module_file(entry)
            raise ConfigError(name, entry, f"importing it raised {type(err).__name__}: {err}"
                                           f"{_where(err, origin)}; fix the plugin") from None
    return resolved
