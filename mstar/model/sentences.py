"""Sentence chunking for the speech families: text cut at sentence ends into pieces a model
can read at once, the first piece kept short.

A TTS model reads a bounded window (Kokoro's 510 phonemes, an LM's prompt budget), and a long
input spoken in one pass comes out worse than the same input spoken a few sentences at a time
(the LM families end early or garble the tail). So the families speak ordered pieces, and the
client hears the first piece as soon as it is synthesised: that is why the first piece has its
own, smaller target. Time to first audio is then one short synthesis, whatever the length of
the text.

``SentenceChunker(limit, target, first_target, measure)`` measures with ``measure`` (``len``,
characters, by default; a tokenizer's count for a token budget):

* sentences end at ``. ! ? ; :`` and ``…`` followed by whitespace, at the CJK full stops
  (``。！？；``), and at line breaks;
* whole sentences are packed into a piece while it stays within its target (the first
  piece's ``first_target``, the others' ``target``); a sentence longer than its target is a
  piece of its own;
* a sentence longer than ``limit`` is cut at its last break that fits (a space, or after a CJK
  comma), else anywhere: no piece is ever over ``limit``.

``split(text, enabled=False)`` is the request's ``sentence_chunking: false``: pieces are cut
only where the limit forces it (both targets become ``limit``).

Torch-free; used by Kokoro (on its phoneme string) and meant for every family that speaks
text in pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SentenceChunker", "split_sentences"]

Measure = Callable[[str], int]

_SENTENCE_END = re.compile(r"(?<=[.!?;:…])\s+|(?<=[。！？；])\s*|\s*\n\s*")
_BREAK_AFTER = "，、,；;"  # a long sentence is cut after these (CJK clauses have no space after the comma)
_NO_SPACE = re.compile(r"[\u3000-\u30ff\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]")


def split_sentences(text: str) -> list[str]:
    """``text``'s sentences, stripped, empty ones dropped."""
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text.strip())) if s]


def _join(left: str, right: str) -> str:
    """Two pieces of text as one: a space between them unless ``left`` ends in CJK text."""
    if not left:
        return right
    return left + right if _NO_SPACE.match(left[-1]) else f"{left} {right}"


def _breaks(sentence: str) -> list[int]:
    """The positions a long sentence may be cut at: each whitespace run's start, and just
    after a clause mark that has no space after it."""
    cuts = [m.start() for m in re.finditer(r"\s+", sentence)]
    cuts += [i + 1 for i, c in enumerate(sentence[:-1]) if c in _BREAK_AFTER and not sentence[i + 1].isspace()]
    return sorted(set(c for c in cuts if c > 0))


def _longest_prefix(text: str, limit: int, measure: Measure) -> int:
    """The length of ``text``'s longest prefix that measures at most ``limit`` (at least one
    character, so that cutting always makes progress)."""
    low, high = 1, len(text)
    while low < high:  # measure is monotone in the prefix length for characters and tokens alike
        mid = (low + high + 1) // 2
        if measure(text[:mid]) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class SentenceChunker:
    """How one family cuts text into pieces (see the module doc)."""

    limit: int
    target: int | None = None  # None: the limit
    first_target: int | None = None  # None: the target
    measure: Measure = field(default=len, compare=False)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")

    def split(self, text: str, enabled: bool = True) -> list[str]:
        """``text`` as ordered pieces, each at most ``limit``; ``enabled=False`` keeps the text
        whole but for the cuts the limit forces."""
        target = min(self.target or self.limit, self.limit) if enabled else self.limit
        first = min(self.first_target or target, self.limit) if enabled else self.limit
        pieces: list[str] = []
        current = ""
        for sentence in (p for s in split_sentences(text) for p in self._fit(s)):
            joined = _join(current, sentence)
            if current and self.measure(joined) > (target if pieces else first):
                pieces.append(current)
                current = sentence
            else:
                current = joined
        if current:
            pieces.append(current)
        return pieces

    def _fit(self, sentence: str) -> list[str]:
        """``sentence`` cut into parts of at most ``limit``, at its last break that fits."""
        parts: list[str] = []
        while self.measure(sentence) > self.limit:
            room = _longest_prefix(sentence, self.limit, self.measure)
            fitting = [c for c in _breaks(sentence) if c <= room]
            cut = fitting[-1] if fitting else room
            parts.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        return [*parts, sentence] if sentence else parts
