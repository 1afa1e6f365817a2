"""Run configurations: `load_config` reads, merges and checks one (`validation.py`; the
vision-language trainer's own checks in `vlm.py`)."""

from pixelrl.config.validation import load_config, validate

__all__ = ["load_config", "validate"]
