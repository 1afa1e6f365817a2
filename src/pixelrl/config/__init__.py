"""Run configurations: `PixelRLConfig` composes the sections their owners define and check
(`sections.py`); `load_config` reads, merges and checks one (`validation.py`: each section's own
checks, then the rules that span sections); `plan.py` sizes a recipe for the user's GPUs."""

from pixelrl.config.sections import PixelRLConfig, from_yaml_text
from pixelrl.config.validation import load_config, validate

__all__ = ["PixelRLConfig", "from_yaml_text", "load_config", "validate"]
