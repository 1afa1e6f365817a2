"""The policy engine: one model + optimizer + adapters (no Ray)."""

from pixelrl.engine.policy_engine import PolicyEngine

__all__ = ["PolicyEngine"]
