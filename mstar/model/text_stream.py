"""Incremental detokenisation with stop strings: emitted token ids -> text deltas."""

from __future__ import annotations

import torch

from mstar.contract import OutputEvent
from mstar.model.spec import OutputStream


class TextStream(OutputStream):
    """Decodes the generated ids incrementally and hands out only the new text.

    Each token is decoded in a short window, not with the whole history: the ids from
    ``prefix`` (already turned into text, kept as context so a tokenizer that drops a
    word's leading space at the start of a string still renders it) up to the newest. The
    window's text past that of ``ids[prefix:read]`` is the new text. So a token costs the
    same at the thousandth position as at the first.

    Text that could still become part of a stop string, or an incomplete UTF-8 sequence,
    is held back until it is settled. When a stop string appears the text is cut before
    it and ``stopped`` turns true.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] are decoded already: the window's context
        self.read = 0  # ids from here on are not text yet
        self.sent = 0  # characters of the decoded text already handed out
        self.text = ""
        self._stopped = False
        # A fast tokenizer whose decode adds nothing to its Rust backend's (no clean-up of
        # spaces) is asked directly: the wrapper's argument conversion costs more than
        # decoding a short window.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if plain else None

    @property
    def generated(self) -> int:
        return len(self.ids)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if self._stopped:
            return None
        # a decode step's token comes as a [1] row (a reshape per token cost more than the rest of
        # this method's Python)
        new = value.tolist() if value.dim() == 1 else value.reshape(-1).tolist()
        self.ids += new
        seen = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if window.endswith("\ufffd") or len(window) <= len(seen):
            return OutputEvent(token_ids=new, completion_tokens=len(self.ids))  # wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        text = self.text + window[len(seen):]
        self.text = text
        cut = self._find_stop(text)
        if cut is not None:
            self.text = text[:cut]
            self._stopped = True
            return self._delta(len(self.text), new)
        return self._delta(max(self.sent, len(text) - self.hold), new)

    def finish(self, reason: str) -> OutputEvent | None:
        if self.sent < len(self.text):
            return self._delta(len(self.text), [])
        return None

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.sent - self.hold)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _delta(self, upto: int, new_ids: list[int]) -> OutputEvent:
        delta = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return OutputEvent(text=delta, token_ids=new_ids, completion_tokens=len(self.ids))


class TokenTextStream(OutputStream):
    """Token ids in, text out, for the speech decoders (the transducers, Canary, Whisper):
    the whole transcript decoded again each step (they are short), special tokens such as
    language tags left out, a partial character held back."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    @property
    def generated(self) -> int:
        return len(self.ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        new = [int(t) for t in value.reshape(-1).tolist()]
        self.ids += new
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return OutputEvent(token_ids=new, completion_tokens=len(self.ids))
        delta, self.sent = text[len(self.sent):], text
        return OutputEvent(text=delta, token_ids=new, completion_tokens=len(self.ids))
