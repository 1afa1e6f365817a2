"""Qwen2-VL family: the vision-language policy adapter, its critic and the offline tiny builder."""

from pixelrl.models.qwen_vl.model import QwenVLModel, TokenBatch, ValueModel, response_mask_from

__all__ = ["QwenVLModel", "TokenBatch", "ValueModel", "response_mask_from"]
