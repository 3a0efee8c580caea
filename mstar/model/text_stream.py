"""Incremental detokenisation with stop strings: emitted token ids -> text deltas."""

from __future__ import annotations

import torch

from mstar.model.spec import OutputStream
from mstar.server.backend import OutputEvent


class TextStream(OutputStream):
    """Decodes the generated ids so far and hands out only the new text.

    Text that could still become part of a stop string, or an incomplete UTF-8 sequence,
    is held back until it is settled. When a stop string appears the text is cut before
    it and ``stopped`` turns true.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.text = ""
        self._stopped = False

    @property
    def generated(self) -> int:
        return len(self.ids)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if self._stopped:
            return None
        new = [int(t) for t in value.reshape(-1).tolist()]
        self.ids += new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return OutputEvent(token_ids=new, completion_tokens=len(self.ids))  # wait for the rest of the character
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

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.sent - self.hold)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _delta(self, upto: int, new_ids: list[int]) -> OutputEvent:
        delta = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return OutputEvent(text=delta, token_ids=new_ids, completion_tokens=len(self.ids))
