"""pixelrl: reinforcement-learning post-training for generative vision models."""

__version__ = "0.1.0"
