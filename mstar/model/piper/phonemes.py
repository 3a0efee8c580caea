"""Text to Piper phoneme ids, the way Piper itself does it.

The phonemes come from espeak-ng through piper-tts's own bridge (``EspeakPhonemizer``: one
phoneme list per sentence, punctuation kept, accents split off by NFD), so they match what the
voice was trained on. The ids follow Piper's framing: BOS, then each phoneme's ids followed by
the padding id, then EOS (``^ _ p1 _ p2 _ ... $``). Phonemes missing from the voice's map are
dropped, as Piper drops them.
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Mapping, Sequence

__all__ = ["BOS", "EOS", "PAD", "EspeakPhonemes", "phonemes_to_ids", "split_phonemes"]

BOS, EOS, PAD = "^", "$", "_"


def split_phonemes(phonemes: str) -> list[str]:
    """A phoneme string as Piper's phonemes: its NFD code points."""
    return list(unicodedata.normalize("NFD", phonemes))


def phonemes_to_ids(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """Piper's id framing of one sentence's phonemes."""
    ids = [*id_map[BOS], *id_map[PAD]]
    for phoneme in phonemes:
        if phoneme in id_map:
            ids.extend(id_map[phoneme])
            ids.extend(id_map[PAD])
    ids.extend(id_map[EOS])
    return ids


class EspeakPhonemes:
    """piper-tts's espeak-ng phonemiser for one espeak voice (``en-us``...).

    espeak-ng keeps global state (the selected voice), so calls are serialised.
    """

    _lock = threading.Lock()

    def __init__(self, voice: str) -> None:
        try:
            from piper.phonemize_espeak import EspeakPhonemizer
        except ImportError as err:
            raise ImportError("piper voices phonemise text with piper-tts: pip install 'mstar[piper]'") from err
        self.voice = voice
        self._phonemizer = EspeakPhonemizer()

    def __call__(self, text: str) -> list[list[str]]:
        """One phoneme list per sentence (empty sentences dropped)."""
        with self._lock:
            sentences = self._phonemizer.phonemize(self.voice, text)
        return [s for s in sentences if s]
