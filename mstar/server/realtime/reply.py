"""What a response sends about its one output item, and the conversation's items.

``Reply`` turns the backend's stream into the item's events: ``open`` (item and content part
added), ``stream`` (text deltas as transcript or text deltas; audio resampled from the
backend's rate to the API's 24 kHz PCM16), ``close`` (the done events, also after a
cancellation, with the text written so far).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar.contract import OutputEvent
from mstar.server.realtime.events import API_RATE, server_event
from mstar.server.realtime.resample import StreamResampler, float_to_pcm16

__all__ = ["Item", "Reply"]


@dataclass
class Item:
    """A conversation item: its ``text`` is what the model reads (a user's audio: its transcript)."""

    id: str
    role: str
    kind: str  # content type: input_text, input_audio, output_text, output_audio
    text: str | None = None
    status: str = "completed"

    def json(self) -> dict[str, Any]:
        field = "text" if self.kind in ("input_text", "output_text") else "transcript"
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [{"type": self.kind, field: self.text}]}


class Reply:
    """The events of one response's single output item, from ``open`` to ``close``."""

    def __init__(self, response_id: str, item_id: str, audio: bool, send: Callable[[dict[str, Any]], None]) -> None:
        self.audio, self.send = audio, send
        self.item = Item(item_id, "assistant", "output_audio" if audio else "output_text", "", "in_progress")
        self.where = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}
        self.opened = False
        self.finish_reason: str | None = None  # the backend's, once it has finished

    def _part(self) -> dict[str, Any]:
        if self.audio:
            return {"type": "audio", "transcript": self.item.text}
        return {"type": "text", "text": self.item.text}

    def open(self, previous: str | None) -> None:
        item = {**self.item.json(), "content": []}
        self.send(server_event("response.output_item.added", response_id=self.where["response_id"], output_index=0,
                               item=item))
        self.send(server_event("conversation.item.added", item=item, previous_item_id=previous))
        self.send(server_event("response.content_part.added", **self.where, part=self._part()))
        self.opened = True

    async def stream(self, events: AsyncIterator[OutputEvent], sample_rate: int) -> dict[str, int]:
        """Relay the backend's events; returns the usage. The iterator is closed however this
        ends (a cancellation included), which cancels the backend's work."""
        resampler = StreamResampler(sample_rate, API_RATE) if self.audio else None
        text_delta = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        prompt_tokens = completion_tokens = 0
        try:
            async for event in events:
                if event.error:
                    raise RuntimeError(event.error)
                if event.text:
                    self.item.text = (self.item.text or "") + event.text
                    self.send(server_event(text_delta, **self.where, delta=event.text))
                if resampler is not None and event.modality == "audio" and event.data:
                    self._audio(resampler.push(np.frombuffer(event.data, "<f4")))
                prompt_tokens = max(prompt_tokens, event.prompt_tokens)
                completion_tokens = max(completion_tokens, event.completion_tokens)
                self.finish_reason = event.finish_reason or self.finish_reason
            if resampler is not None:
                self._audio(resampler.flush())
        finally:
            closer = getattr(events, "aclose", None)
            if closer is not None:
                await closer()
        return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _audio(self, samples: np.ndarray) -> None:
        if len(samples):
            delta = base64.b64encode(float_to_pcm16(samples)).decode()
            self.send(server_event("response.output_audio.delta", **self.where, delta=delta))

    def close(self, status: str) -> Item | None:
        """The closing events of the item (None: it was never opened)."""
        if not self.opened:
            return None
        text = self.item.text or ""
        if self.audio:
            self.send(server_event("response.output_audio.done", **self.where))
            self.send(server_event("response.output_audio_transcript.done", **self.where, transcript=text))
        else:
            self.send(server_event("response.output_text.done", **self.where, text=text))
        self.send(server_event("response.content_part.done", **self.where, part=self._part()))
        self.item.status = "completed" if status == "completed" else "incomplete"
        self.send(server_event("response.output_item.done", response_id=self.where["response_id"], output_index=0,
                               item=self.item.json()))
        self.send(server_event("conversation.item.done", item=self.item.json()))
        return self.item
