"""From a request's text to chunks of phoneme ids.

G2P is misaki's English (``lang_code`` ``a``: American, ``b``: British), built on first use and
only when misaki and its spaCy tagger (``en_core_web_sm``) are installed: misaki would
otherwise try to download the tagger inside a request. Without them text input is refused with
the install hint, and a request can still send ``phonemes`` (no G2P).

Chunking: Kokoro reads at most ``max_input_tokens - 2`` phonemes at once (the PL-BERT window
less the two boundary pads). The phoneme string is cut after sentence ends into chunks packed
up to ``target`` phonemes, the first up to ``first_target`` (a short first chunk: time to first
audio is one short synthesis); a sentence longer than the window is cut at the last space
(else anywhere) before it. ``mstar.model.sentences.SentenceChunker`` does it for every family.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable

from mstar.contract import RequestError
from mstar.model.sentences import SentenceChunker

__all__ = ["G2P_HINT", "EnglishG2P", "chunk_phonemes", "to_ids"]

G2P_HINT = (
    "pip install 'mstar-ai[kokoro]' and python -m spacy download en_core_web_sm on the server, "
    "or send the phonemes yourself in 'phonemes'"
)
LANGUAGES = {"a": "American English", "b": "British English"}


def to_ids(phonemes: str, vocab: dict[str, int]) -> list[int]:
    """Ids of the phonemes ``vocab`` knows (others are skipped, as the reference skips them)."""
    return [vocab[p] for p in phonemes if p in vocab]


def chunk_phonemes(phonemes: str, limit: int, target: int, first_target: int, enabled: bool = True) -> list[str]:
    """``phonemes`` cut at sentence ends into chunks of at most ``limit`` characters, packed to
    ``target`` (the first to ``first_target``); ``enabled=False`` (a request's
    ``sentence_chunking: false``) cuts only where the window forces it. The shared
    ``SentenceChunker`` does the cutting."""
    return SentenceChunker(limit, target, first_target).split(phonemes, enabled)


def g2p_available() -> bool:
    """misaki's English G2P and its spaCy tagger are installed (nothing is downloaded)."""
    if importlib.util.find_spec("misaki") is None or importlib.util.find_spec("spacy") is None:
        return False
    return importlib.util.find_spec("en_core_web_sm") is not None


class EnglishG2P:
    """misaki's English G2P per ``lang_code``, built once, called under a lock (spaCy pipelines
    are not meant for concurrent calls)."""

    def __init__(self, espeak_fallback: bool = False,
                 available: Callable[[], bool] = g2p_available) -> None:
        self.espeak_fallback = espeak_fallback
        self.available = available
        self._g2p: dict[str, Callable[[str], tuple[str, object]]] = {}
        self._lock = threading.Lock()

    def _build(self, lang_code: str):
        from misaki import en  # the optional G2P dependency

        fallback = None
        if self.espeak_fallback:
            try:
                from misaki import espeak

                fallback = espeak.EspeakFallback(british=lang_code == "b")
            except Exception:  # espeak-ng missing: out-of-dictionary words are skipped
                fallback = None
        return en.G2P(trf=False, british=lang_code == "b", fallback=fallback)

    def __call__(self, text: str, lang_code: str) -> str:
        if lang_code not in LANGUAGES:
            raise RequestError("lang_code", f"{lang_code!r} is not served here; served: "
                                            + ", ".join(f"{k} ({v})" for k, v in LANGUAGES.items()))
        if not self.available():
            raise RequestError("input", f"text input needs misaki's English G2P, which is not installed: {G2P_HINT}")
        with self._lock:
            if lang_code not in self._g2p:
                self._g2p[lang_code] = self._build(lang_code)
            phonemes, _ = self._g2p[lang_code](text)
        return phonemes
