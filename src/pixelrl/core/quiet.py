"""Keep library chatter (progress bars, advisory warnings) out of pixelrl's own output."""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights only ever come from local folders
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
