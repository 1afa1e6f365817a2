"""Framework-agnostic building blocks: errors, registries, the Batch container, seeding."""

from pixelrl.core.batch import Batch
from pixelrl.core.errors import PixelRLError, ConfigError, MissingBatchKeysError, RewardError
from pixelrl.core.registry import Registry

__all__ = ["Batch", "PixelRLError", "ConfigError", "MissingBatchKeysError", "RewardError", "Registry"]
