"""Token ids to text for the speech families whose decoders emit plain token ids (the
transducers, Canary): the client gets each new piece of the decoded transcript."""

from __future__ import annotations

import torch

from mstar.contract import OutputEvent
from mstar.model.spec import OutputStream


class TokenTextStream(OutputStream):
    """Token ids in, text out (special tokens such as language tags left out); holds back a
    partial character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    @property
    def generated(self) -> int:
        return len(self.ids)

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        new = [int(t) for t in value.reshape(-1).tolist()]
        self.ids += new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return OutputEvent(token_ids=new, completion_tokens=len(self.ids))
        delta, self.sent = text[len(self.sent):], text
        return OutputEvent(text=delta, token_ids=new, completion_tokens=len(self.ids))
