"""Keep library chatter (progress bars, advisory warnings) out of pixelrl's own output.

diffusers and transformers are quietened when they are first imported, not imported to be
quietened: importing diffusers pulls in torch._dynamo, and a command that loads no model
(`--help`, `config`, `plan`, `plot`, `report`) would pay one to two seconds for it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys


def _quiet(logging) -> None:  # diffusers' and transformers' logging modules share these two calls
    logging.disable_progress_bar()
    logging.set_verbosity_error()


QUIETERS = {"diffusers.utils.logging": _quiet, "transformers.utils.logging": _quiet}


class _QuietOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module in `waiting` it lets the path finder find it and runs
    the module's quieter right after the module has executed."""

    def __init__(self, waiting: dict):
        self.waiting = waiting

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        quieter, execute = self.waiting.pop(name), spec.loader.exec_module

        def execute_then_quiet(module):
            execute(module)
            quieter(module)

        spec.loader.exec_module = execute_then_quiet
        return spec


def quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights only ever come from local folders
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    waiting = {}
    for name, quieter in QUIETERS.items():
        if name in sys.modules:
            quieter(sys.modules[name])
        else:
            waiting[name] = quieter
    if waiting and not any(isinstance(finder, _QuietOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietOnImport(waiting))
