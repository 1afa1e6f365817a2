"""Sequence parallelism against the model and the run: rules spanning `trainer:` and `model:`."""

from __future__ import annotations

from pixelrl.config.sections import PixelRLConfig
from pixelrl.core.errors import ConfigError


def check_sequence_parallel(cfg: PixelRLConfig) -> None:
    """A sequence group splits each sample's tokens of a family whose model has a split plan,
    over whole attention heads, with the blocks run eagerly."""
    t, m = cfg.trainer, cfg.model
    size = t.sequence_parallel_size
    if size == 1:
        return
    from pixelrl.models.loader import family_spec, folder_transformer

    spec = family_spec(m.type)
    if not spec.splits_sequence:
        raise ConfigError("trainer.sequence_parallel_size", size, f"the {m.type} family has no sequence split "
                          "(families with one: wan): use 1")
    if m.compile is True:
        raise ConfigError("trainer.sequence_parallel_size", size, "compiled blocks under a sequence split are not "
                          "supported yet: set model.compile=false (auto compiles nothing while the split is on)")
    transformer = folder_transformer(m.path)[1] or (spec.release.transformer if spec.release else {})
    heads = transformer.get("num_attention_heads")
    if heads is not None and heads % size:
        raise ConfigError("trainer.sequence_parallel_size", size, f"each rank of a sequence group attends with an "
                          f"equal share of the model's {heads} attention heads: use a divisor of {heads}")
