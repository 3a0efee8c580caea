"""Voice cloning, shared by the speech families that clone (Chatterbox, CosyVoice3, Qwen3-TTS
Base): how a family declares it, a memo of clip conditioning keyed by content, and preset
voices from a deployment's ``voices_dir``.

A family clones by mixing ``VoiceCloning`` into its ``ModelSpec`` and writing one method,
``condition_on_clip(samples, sample_rate, ref_text)``: the decoded clip (float32 mono at its
own rate) and its transcript in, whatever the family's walk needs out (a speaker x-vector,
prompt speech tokens, a prompt mel, ...). Its ``prepare_speech`` then asks
``self.clip_conditioning(spec.reference)`` and gets the memoised value: encoding a clip
(a speaker encoder, a speech tokenizer) costs as much as a short synthesis, and clients send
the same clip again and again (a voice reused across requests, or the sentence pieces of one
long request), so a clip is encoded once per content.

The memo's key is a hash of the samples, the rate, the transcript and the model, so two
uploads of the same clip hit whatever their file format was, and a changed transcript is a
new entry (zero-shot cloning conditions on it). It is an LRU bounded by entries
(``clip_memo_size``); concurrent requests for one clip wait for a single encoding.

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
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from mstar.contract import RequestError, Voice, VoiceClip

__all__ = ["AUDIO_SUFFIXES", "ClipMemo", "VoiceCloning", "VoicePresets", "clip_key"]

T = TypeVar("T")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


def clip_key(model: str, clip: VoiceClip) -> str:
    """The memo key of ``clip`` for ``model``: a SHA-256 over all that decides its conditioning."""
    h = hashlib.sha256()
    for part in (model, str(clip.sample_rate), clip.text if clip.text is not None else "\0none"):
        h.update(part.encode())
        h.update(b"\0")
    h.update(clip.pcm)
    return h.hexdigest()


class ClipMemo(Generic[T]):
    """A thread-safe LRU of at most ``capacity`` values by key; ``get(key, compute)`` runs
    ``compute`` once per missing key, however many threads ask at once (the others wait for
    its result). A failed ``compute`` is not remembered: the next ask tries again."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._done: OrderedDict[str, T] = OrderedDict()
        self._running: dict[str, Future[T]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._done

    def clear(self) -> None:
        """Forget every finished value (encodings under way finish as usual)."""
        with self._lock:
            self._done.clear()

    def get(self, key: str, compute: Callable[[], T]) -> T:
        with self._lock:
            if key in self._done:
                self.hits += 1
                self._done.move_to_end(key)
                return self._done[key]
            running = self._running.get(key)
            if running is None:
                self.misses += 1
                mine: Future[T] = Future()
                self._running[key] = mine
        if running is not None:
            with self._lock:
                self.hits += 1
            return running.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._running[key]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._running[key]
            self._done[key] = value
            while len(self._done) > self.capacity:
                self._done.popitem(last=False)
        mine.set_result(value)
        return value


class VoiceCloning(ABC):
    """Mixed into a speech ``ModelSpec`` that clones voices (see the module doc). The spec
    must have ``key`` and ``config`` (every ``ModelSpec`` does)."""

    clones_voices: ClassVar[bool] = True
    clip_memo_size: ClassVar[int] = 64
    """Clips whose conditioning is kept; the least recently used goes first."""

    @abstractmethod
    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> Any:
        """The family's conditioning for one reference clip: ``samples`` float32 mono at
        ``sample_rate`` (as the client sent it, 8 kHz and up, at most 60 s), ``ref_text`` its
        transcript or None. Raise ``RequestError("ref_audio" | "ref_text", ...)`` for a clip
        the family cannot use (too short, a transcript it requires). Runs in the API server's
        prepare thread: the value must not be mutated by its users, since later requests get
        the same object."""

    @property
    def clip_memo(self) -> ClipMemo[Any]:
        memo = self.__dict__.get("_clip_memo")
        if memo is None:
            memo = self.__dict__.setdefault("_clip_memo", ClipMemo(self.clip_memo_size))
        return memo

    def clip_conditioning(self, clip: VoiceClip) -> Any:
        """``condition_on_clip`` of ``clip``, computed once per content."""
        model = f"{self.key}:{self.config.model_path or ''}"  # type: ignore[attr-defined]
        samples = np.frombuffer(clip.pcm, dtype="<f4")
        return self.clip_memo.get(clip_key(model, clip),
                                  lambda: self.condition_on_clip(samples, clip.sample_rate, clip.text))


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
