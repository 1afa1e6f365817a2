"""Error types. Each message names the thing at fault, the value seen, and the fix."""


class PixelRLError(Exception):
    """Base class for every error pixelrl raises on bad input."""


class ConfigError(PixelRLError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible in combination."""

    def __init__(self, field: str, value, fix: str):
        self.field, self.value, self.fix = field, value, fix
        kind = "argument" if field.startswith(("-", "<")) else "config field"  # command-line flags and <positionals> share the format
        super().__init__(f"{kind} `{field}` = {value!r}: {fix}")


def require_integer(field: str, value, least: int) -> None:
    """Stop with a ConfigError naming `field` unless `value` is an integer (never a bool) >= `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(field, value, f"an integer >= {least}")


class MissingBatchKeysError(PixelRLError, KeyError):
    """A loss or estimator needs batch keys that the batch does not carry."""

    def __init__(self, consumer: str, missing, available):
        self.consumer, self.missing, self.available = consumer, sorted(missing), sorted(available)
        super().__init__(
            f"{consumer} needs batch keys {self.missing} that are missing; "
            f"available keys: {self.available}"
        )

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return self.args[0]


class RewardError(PixelRLError, ValueError):
    """A reward function returned something other than finite float tensors of shape [B]."""


class ModelFolderError(PixelRLError, FileNotFoundError):
    """A model folder is missing or does not hold a loadable pipeline."""


def check_choice(field: str, value, options) -> None:
    """Stop with a ConfigError naming `field` unless `value` is one of `options`."""
    if value not in options:
        raise ConfigError(field, value, f"choose one of {list(options)}")


# A size the memory plan chooses at start-up (actor.ppo_micro_batch_size, rollout.micro_batch_size,
# model.gradient_checkpointing): the largest that fits the device's memory (pixelrl.config.plan).
AUTO = "auto"


def check_size(field: str, value) -> None:
    """A positive whole number of samples, or `auto`."""
    if value == AUTO:
        return
    if isinstance(value, str):
        raise ConfigError(field, value, f"a positive whole number, or {AUTO} (the largest that fits the device's "
                          "memory, chosen at start-up)")
    check_number(field, value)


def check_number(field: str, value, allow_zero: bool = False, allow_inf: bool = False) -> None:
    """Stop with a ConfigError naming `field` unless `value` is a positive number (or zero, or
    infinite, where allowed: an infinite clip means no clipping)."""
    if value != value or (value == float("inf") and not allow_inf):  # NaN, inf
        raise ConfigError(field, value, "must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(field, value, "must be " + ("non-negative" if allow_zero else "positive"))
