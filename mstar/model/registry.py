"""The model registry: registry key -> ModelSpec class."""

from __future__ import annotations

import importlib

from mstar.model.spec import ModelSpec

_REGISTRY: dict[str, type[ModelSpec]] = {}

# Families are imported on first lookup so that `import mstar` stays light.
_FAMILIES = ("mstar.model.llama.model", "mstar.model.whisper.model", "mstar.model.orpheus.model",
             "mstar.model.flux2.model", "mstar.model.flux2.guided",
             "mstar.model.qwen3_5.model",
             "mstar.model.z_image.model")


def register(cls: type[ModelSpec]) -> type[ModelSpec]:
    if cls.key in _REGISTRY and _REGISTRY[cls.key] is not cls:
        raise ValueError(f"model key {cls.key!r} is registered twice")
    _REGISTRY[cls.key] = cls
    return cls


_UNAVAILABLE: dict[str, str] = {}  # family module -> why it could not be imported


def _load_families() -> None:
    """Import every family; one whose optional dependencies are missing (soundfile for the
    speech families, say) is skipped, and named if its key is asked for."""
    for module in _FAMILIES:
        if module in _UNAVAILABLE:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            _UNAVAILABLE[module] = str(err)


def model_class(key: str) -> type[ModelSpec]:
    _load_families()
    try:
        return _REGISTRY[key]
    except KeyError:
        missing = "".join(f"; {m} is unavailable ({why})" for m, why in _UNAVAILABLE.items())
        raise ValueError(f"model: unknown model {key!r}; registered: {sorted(_REGISTRY)}{missing}") from None


def registered() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)
