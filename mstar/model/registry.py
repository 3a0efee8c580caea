"""The model registry: registry key -> ModelSpec class."""

from __future__ import annotations

import importlib

from mstar.model.spec import ModelSpec

_REGISTRY: dict[str, type[ModelSpec]] = {}

# Families are imported on first lookup so that `import mstar` stays light.
_FAMILIES = ("mstar.model.llama.model", "mstar.model.whisper.model", "mstar.model.orpheus.model")


def register(cls: type[ModelSpec]) -> type[ModelSpec]:
    if cls.key in _REGISTRY and _REGISTRY[cls.key] is not cls:
        raise ValueError(f"model key {cls.key!r} is registered twice")
    _REGISTRY[cls.key] = cls
    return cls


def _load_families() -> None:
    for module in _FAMILIES:
        importlib.import_module(module)


def model_class(key: str) -> type[ModelSpec]:
    _load_families()
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"model: unknown model {key!r}; registered: {sorted(_REGISTRY)}") from None


def registered() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)
