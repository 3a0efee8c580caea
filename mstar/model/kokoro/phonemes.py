"""From a request's text to chunks of phoneme ids.

G2P is misaki's, per Kokoro ``lang_code``, as the reference pipeline picks it: English
(``a`` American, ``b`` British) through misaki's lexicon and spaCy tagger; Spanish, French,
Hindi, Italian and Brazilian Portuguese (``e f h i p``) through espeak-ng (misaki's
``EspeakG2P``); Japanese (``j``) and Mandarin (``z``) through misaki's own front ends. Each is
built on first use and only when its packages are installed: misaki would otherwise try to
download a tagger or a dictionary inside a request. A language whose G2P is missing answers
400 with its install hint; a request can always send ``phonemes`` instead (no G2P).

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
from dataclasses import dataclass
from pathlib import Path

from mstar.contract import RequestError
from mstar.model.sentences import SentenceChunker

__all__ = ["G2P", "LANGUAGES", "chunk_phonemes", "g2p_hint", "installed", "to_ids"]


@dataclass(frozen=True)
class Language:
    name: str
    modules: tuple[str, ...]  # what its G2P imports (checked without importing)
    hint: str  # what to install on the server
    espeak: str | None = None  # espeak-ng's voice, for the languages spoken through it


_EN_HINT = "pip install 'mstar-ai[kokoro]' and python -m spacy download en_core_web_sm on the server"
_ESPEAK = ("misaki", "phonemizer", "espeakng_loader")
_ESPEAK_HINT = "pip install 'misaki[en]==0.9.4' on the server (it brings espeak-ng)"
LANGUAGES: dict[str, Language] = {
    "a": Language("American English", ("misaki", "spacy", "en_core_web_sm"), _EN_HINT),
    "b": Language("British English", ("misaki", "spacy", "en_core_web_sm"), _EN_HINT),
    "e": Language("Spanish", _ESPEAK, _ESPEAK_HINT, "es"),
    "f": Language("French", _ESPEAK, _ESPEAK_HINT, "fr-fr"),
    "h": Language("Hindi", _ESPEAK, _ESPEAK_HINT, "hi"),
    "i": Language("Italian", _ESPEAK, _ESPEAK_HINT, "it"),
    "p": Language("Brazilian Portuguese", _ESPEAK, _ESPEAK_HINT, "pt-br"),
    "j": Language("Japanese", ("misaki", "pyopenjtalk"),
                  "pip install 'misaki[ja]==0.9.4' on the server and let pyopenjtalk fetch its dictionary "
                  "once (python -c 'import pyopenjtalk; pyopenjtalk.g2p(\"a\")')"),
    "z": Language("Mandarin Chinese", ("misaki", "jieba", "pypinyin", "cn2an", "ordered_set", "pypinyin_dict"),
                  "pip install 'misaki[zh]==0.9.4' on the server"),
}
"""Kokoro's languages by ``lang_code`` (the first letter of its voices' names)."""


def installed(lang_code: str) -> bool:
    """The G2P of ``lang_code`` can be built here without downloading anything."""
    if not all(importlib.util.find_spec(module) is not None for module in LANGUAGES[lang_code].modules):
        return False
    return lang_code != "j" or _open_jtalk_dictionary()


def _open_jtalk_dictionary() -> bool:
    """pyopenjtalk's dictionary is in place (it downloads it on first use otherwise)."""
    spec = importlib.util.find_spec("pyopenjtalk")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return any(d.is_dir() for folder in folders for d in folder.glob("open_jtalk_dic*"))


def g2p_hint(lang_code: str) -> str:
    return f"{LANGUAGES[lang_code].hint}, or send the phonemes yourself in 'phonemes'"


def to_ids(phonemes: str, vocab: dict[str, int]) -> list[int]:
    """Ids of the phonemes ``vocab`` knows (others are skipped, as the reference skips them)."""
    return [vocab[p] for p in phonemes if p in vocab]


def chunk_phonemes(phonemes: str, limit: int, target: int, first_target: int, enabled: bool = True) -> list[str]:
    """``phonemes`` cut at sentence ends into chunks of at most ``limit`` characters, packed to
    ``target`` (the first to ``first_target``); ``enabled=False`` (a request's
    ``sentence_chunking: false``) cuts only where the window forces it. The shared
    ``SentenceChunker`` does the cutting."""
    return SentenceChunker(limit, target, first_target).split(phonemes, enabled)


class G2P:
    """misaki's G2P per ``lang_code``, each built once and called under a lock (spaCy pipelines
    and espeak-ng's library are not meant for concurrent calls)."""

    def __init__(self, espeak_fallback: bool = False, available: Callable[[str], bool] = installed) -> None:
        self.espeak_fallback = espeak_fallback
        self.available = available
        self._g2p: dict[str, Callable[[str], tuple[str, object]]] = {}
        self._lock = threading.Lock()

    def _build(self, lang_code: str) -> Callable[[str], tuple[str, object]]:
        # misaki's front ends are optional dependencies, imported on first use
        language = LANGUAGES[lang_code]
        if language.espeak is not None:
            from misaki import espeak

            return espeak.EspeakG2P(language=language.espeak)
        if lang_code == "j":
            from misaki import ja

            return ja.JAG2P()
        if lang_code == "z":
            from misaki import zh

            return zh.ZHG2P(version=None)  # Kokoro-82M's (v1.0) Mandarin front end
        from misaki import en

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
            raise RequestError("lang_code", f"{lang_code!r} is not a Kokoro language; they are: "
                                            + ", ".join(f"{k} ({v.name})" for k, v in LANGUAGES.items()))
        if lang_code not in self._g2p and not self.available(lang_code):  # probed until built, not per request
            raise RequestError("input", f"text in {LANGUAGES[lang_code].name} needs a G2P that is not "
                                            f"installed: {g2p_hint(lang_code)}")
        with self._lock:
            if lang_code not in self._g2p:
                self._g2p[lang_code] = self._build(lang_code)
            phonemes, _ = self._g2p[lang_code](text)
        return phonemes or ""
