"""What a command that loads no model imports: not diffusers (which pulls in torch._dynamo) nor
transformers, and the libraries are still quiet once a later command imports them."""

import subprocess
import sys

import pytest

PROBE = """
import sys
from pixelrl.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in ("diffusers", "transformers", "torch._dynamo", "ray") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["config", "--config-name", "shapes_demo"]])
def test_a_command_that_loads_no_model_imports_no_model_library(argv):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def test_the_libraries_are_quiet_when_they_are_imported_after_the_command_starts():
    code = ("from pixelrl.core.quiet import quiet_libraries\nquiet_libraries()\n"
            "import diffusers.utils.logging as d, transformers.utils.logging as t\n"
            "print(d._tqdm_active, t._tqdm_active, d.get_verbosity(), t.get_verbosity())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False", "40", "40"], done.stderr[-2000:]
