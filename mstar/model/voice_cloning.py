"""Voice cloning, shared by the speech families that clone (Chatterbox, CosyVoice3, Qwen3-TTS
Base, OmniVoice): how a family declares it, a memo of clip conditioning keyed by content, and preset
voices from a deployment's ``voices_dir``.

A family clones by mixing ``VoiceCloning`` into its ``ModelSpec`` and writing one method,
``condition_on_clip(samples, sample_rate, ref_text)``: the decoded clip (float32 mono at its
own rate) and its transcript in, whatever the family's walk needs out (a speaker x-vector,
prompt speech tokens, a prompt mel, ...). Its ``prepare_speech`` then asks
``self.clip_conditioning(spec.reference)`` and gets the memoised value: encoding a clip
(a speaker encoder, a speech tokenizer) costs as much as a short synthesis, and clients send
the same clip again and again (a voice reused across requests, or the sentence pieces of one
long request), so a clip is encoded once per content.

The memo's key is a hash of the samples, the rate, the encoder (the model, its weights and
``conditioning_version``) and, for a family whose conditioning reads it
(``conditions_on_text``), the transcript: two uploads of the same clip hit whatever their file
format was, and a family that encodes the audio alone (an x-vector, codec frames) keeps one
entry for a clip sent with different transcripts. It is an LRU bounded by entries
(``clip_memo_size``) and by bytes (the ``conditioning_cache_mib`` knob of
``ConditioningCacheKnobs``; 0 turns the memo off); concurrent requests for one clip wait for a
single encoding. Its running counts are the backend's ``conditioning_cache_*`` gauges
(/metrics).

The route (``ref_audio``) and the backend read ``clones_voices`` to refuse a clip, with a 400
naming ``ref_audio``, before it reaches a model that cannot use it.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from pydantic import Field

from mstar.contract import RequestError, Voice, VoiceClip
from mstar.model.knobs import Knobs

__all__ = ["AUDIO_SUFFIXES", "ClipMemo", "ConditioningCacheKnobs", "VoiceCloning", "VoicePresets", "clip_key",
           "size_of"]

T = TypeVar("T")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


def clip_key(model: str, clip: VoiceClip, *, with_text: bool = True) -> str:
    """The memo key of ``clip`` for ``model``: a SHA-256 over all that decides its conditioning
    (the transcript only ``with_text``)."""
    h = hashlib.sha256()
    text = ("none" if clip.text is None else "text:" + clip.text) if with_text else "unread"
    for part in (model, str(clip.sample_rate), text):
        h.update(part.encode())
        h.update(b"\0")
    h.update(clip.pcm)
    return h.hexdigest()


def size_of(value: Any) -> int:
    """The bytes a memoised value holds: its tensors' and arrays' data, its strings', summed
    through dataclasses, mappings and sequences (anything else counts 0)."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (str, bytes)):
        return len(value)
    if is_dataclass(value) and not isinstance(value, type):
        return sum(size_of(getattr(value, f.name)) for f in fields(value))
    if isinstance(value, dict):
        return sum(size_of(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(size_of(v) for v in value)
    return 0


class ClipMemo(Generic[T]):
    """A thread-safe LRU of at most ``capacity`` values and ``max_bytes`` bytes of them
    (``size_of``; None: no byte bound) by key; ``get(key, compute)`` runs ``compute`` once per
    missing key, however many threads ask at once (the others wait for its result). A failed
    ``compute`` is not remembered: the next ask tries again. A value over ``max_bytes`` on its
    own is returned but not kept. ``capacity`` 0 (or ``max_bytes`` 0): off, every ask computes."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        if capacity < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"capacity and max_bytes must be >= 0, got {capacity} and {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.bytes = 0
        self._done: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._running: dict[str, Future[T]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.max_bytes != 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._done

    def keys(self) -> list[str]:
        """The kept keys, least recently used first."""
        with self._lock:
            return list(self._done)

    def clear(self) -> None:
        """Forget every finished value (encodings under way finish as usual)."""
        with self._lock:
            self._done.clear()
            self.bytes = 0

    def stats(self) -> dict[str, float]:
        """Running hit and miss counts, and the entries and bytes kept now."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._done), "bytes": self.bytes}

    def get(self, key: str, compute: Callable[[], T]) -> T:
        if not self.enabled:
            with self._lock:
                self.misses += 1
            return compute()
        with self._lock:
            if key in self._done:
                self.hits += 1
                self._done.move_to_end(key)
                return self._done[key][0]
            running = self._running.get(key)
            if running is None:
                self.misses += 1
                mine: Future[T] = Future()
                self._running[key] = mine
            else:
                self.hits += 1
        if running is not None:
            return running.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._running[key]
            mine.set_exception(exc)
            raise
        size = size_of(value)
        with self._lock:
            del self._running[key]
            if self.max_bytes is None or size <= self.max_bytes:
                self._done[key] = (value, size)
                self.bytes += size
                while len(self._done) > self.capacity or (self.max_bytes is not None and self.bytes > self.max_bytes):
                    self.bytes -= self._done.popitem(last=False)[1][1]
        mine.set_result(value)
        return value


class ConditioningCacheKnobs(Knobs):
    """The memo's byte bound, mixed into the ``Knobs`` of a family that clones."""

    conditioning_cache_mib: int = Field(64, ge=0)
    """MiB of reference-clip conditioning (x-vectors, codec frames) kept by content, least
    recently used out first; 0 turns the memo off (every clip is encoded each time)."""


class VoiceCloning(ABC):
    """Mixed into a speech ``ModelSpec`` that clones voices (see the module doc). The spec
    must have ``key`` and ``config`` (every ``ModelSpec`` does)."""

    clones_voices: ClassVar[bool] = True
    clip_memo_size: ClassVar[int] = 64
    """Clips whose conditioning is kept; the least recently used goes first (the bytes they
    may take: ``knobs.conditioning_cache_mib`` where the family's knobs have it)."""

    conditions_on_text: ClassVar[bool] = True
    """Whether ``condition_on_clip`` reads the transcript. False: it is handed None, and a clip
    sent with another transcript is the same entry."""

    conditioning_version: ClassVar[int] = 1
    """Part of the key: raise it when what ``condition_on_clip`` returns changes."""

    @abstractmethod
    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> Any:
        """The family's conditioning for one reference clip: ``samples`` float32 mono at
        ``sample_rate`` (as the client sent it, 8 kHz and up, at most 60 s), ``ref_text`` its
        transcript or None (always None unless ``conditions_on_text``). Raise
        ``RequestError("ref_audio" | "ref_text", ...)`` for a clip the family cannot use (too
        short, a transcript it requires). Runs in the API server's prepare thread: the value
        must not be mutated by its users, since later requests get the same object."""

    @property
    def clip_memo(self) -> ClipMemo[Any]:
        memo = self.__dict__.get("_clip_memo")
        if memo is None:
            mib = getattr(getattr(self, "knobs", None), "conditioning_cache_mib", None)
            memo = self.__dict__.setdefault("_clip_memo", ClipMemo(self.clip_memo_size,
                                                                   None if mib is None else mib << 20))
        return memo

    def clip_conditioning(self, clip: VoiceClip) -> Any:
        """``condition_on_clip`` of ``clip``, computed once per content."""
        config = self.config  # type: ignore[attr-defined]
        encoder = f"{self.key}:{config.model_path or ''}:{getattr(config, 'load_format', '')}:" \
                  f"v{self.conditioning_version}"  # type: ignore[attr-defined]
        samples = np.frombuffer(clip.pcm, dtype="<f4")
        text = clip.text if self.conditions_on_text else None
        return self.clip_memo.get(clip_key(encoder, clip, with_text=self.conditions_on_text),
                                  lambda: self.condition_on_clip(samples, clip.sample_rate, text))


class VoicePresets:
    """The preset voices of a deployment's ``voices_dir``: ``<name>.wav`` (or .flac, .ogg,
    .mp3) with its transcript in ``<name>.txt`` beside it (optional). A preset is a
    ``VoiceClip`` the family conditions on like an uploaded one (and memoises the same way);
    each file is decoded once, on first use, with the upload rules (a bad file is an error
    naming ``voice``). ``language``: what /v1/audio/voices says of each preset."""

    def __init__(self, directory: str | Path, language: str | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"voices_dir: {str(self.directory)!r} is not a directory")
        self.language = language
        self._files = {p.stem: p for p in sorted(self.directory.iterdir())
                       if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file()}
        self._clips: dict[str, VoiceClip] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self._files)

    def voices(self) -> list[Voice]:
        return [Voice(name, self.language, "preset") for name in self._files]

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def clip(self, name: str) -> VoiceClip:
        """The decoded clip of preset ``name`` with its transcript."""
        from mstar.audio.io import AudioError
        from mstar.audio.reference import decode_reference

        if name not in self._files:
            known = ", ".join(self._files) or "none"
            raise RequestError("voice", f"unknown voice {name!r}; the presets are {known}")
        with self._lock:
            if name not in self._clips:
                path = self._files[name]
                transcript = path.with_suffix(".txt")
                text = transcript.read_text().strip() if transcript.is_file() else None
                try:
                    self._clips[name] = decode_reference(path.read_bytes(), text=text, field="voice")
                except AudioError as err:
                    raise RequestError("voice", f"the preset {name!r} is unusable: {err.message}") from None
            return self._clips[name]
