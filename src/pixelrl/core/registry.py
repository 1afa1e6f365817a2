"""A tiny name -> object registry, shared by losses, advantage estimators, rewards and trainers.

A registry holds what the imported modules registered, nothing more: a lookup never imports. The
built-in extensions (the shapes world, the VLM trainer) register their entries like a user's
plugin, imported by the entry points (the CLI, the config loader, every worker's start-up:
`pixelrl.core.plugins.import_extensions`)."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from pixelrl.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, config_field: str):
        # `config_field` is the config key users set to choose an entry; errors name it.
        self.kind = kind
        self.config_field = config_field
        self._entries: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._entries and self._entries[key] is not obj:
                    raise ValueError(f"{self.kind} `{key}` is already registered")
                self._entries[key] = obj
            return obj

        return decorator

    def get(self, name: str, field: str | None = None) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                field or self.config_field, name,
                f"unknown {self.kind}; choose one of {sorted(self._entries)}, or register your own in a module "
                "or .py file listed under `plugins:` (imported in every worker)") from None

    def entries(self) -> list[T]:
        """Every registered object once (aliases share one), in registration order."""
        return list({id(obj): obj for obj in self._entries.values()}.values())

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
