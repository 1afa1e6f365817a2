"""pixelrl: reinforcement-learning post-training for generative vision models."""

from pixelrl.core.plugins import register_extensions

__version__ = "0.1.0"

# The embedded shapes world and the VLM trainer register their names (rewards, a trainer type,
# question tasks) as a user's plugin does; every process imports this package first, so every
# process can find them, and no lower package names them.
register_extensions("pixelrl.vlm", "pixelrl.shapes")
