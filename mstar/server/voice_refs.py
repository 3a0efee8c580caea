"""A request's voice to clone (``ref_audio`` and its transcript ``ref_text``), shared by
/v1/audio/speech and /generate: refused at once when the model does not clone, else resolved
(``mstar.media.fetch``: data URI or base64 always, http(s) only with ``MSTAR_ALLOW_REMOTE=1``,
server paths never) and decoded off the event loop (``mstar.audio.reference``). Every
refusal is a 4xx naming the field, before the backend sees the request."""

from __future__ import annotations

import anyio

from mstar.audio.io import AudioError
from mstar.audio.reference import MAX_BYTES, decode_reference
from mstar.contract import RequestError, VoiceClip
from mstar.media.fetch import fetch_media

MAX_REF_TEXT_CHARS = 4096


def clones_voices(backend: object) -> bool:
    """Whether the backend's model clones a voice from a clip (absent: it does not)."""
    return bool(getattr(backend, "clones_voices", False))


async def resolve_reference(backend: object, model: str, ref_audio: object, ref_text: object) -> VoiceClip | None:
    """The checked clip of ``ref_audio`` (None when the request has none)."""
    if ref_audio is None:
        if ref_text is not None:
            raise RequestError("ref_text", "is the transcript of ref_audio; send it with ref_audio")
        return None
    if not clones_voices(backend):
        raise RequestError("ref_audio", f"model {model!r} does not support voice cloning; send no ref_audio")
    if not isinstance(ref_audio, str):
        raise RequestError("ref_audio", "must be a string: a data URI, base64, or an http(s) URL")
    if ref_text is not None and not isinstance(ref_text, str):
        raise RequestError("ref_text", "must be a string")
    if isinstance(ref_text, str) and len(ref_text) > MAX_REF_TEXT_CHARS:
        raise RequestError("ref_text", f"is {len(ref_text)} characters; the limit is {MAX_REF_TEXT_CHARS}")
    data = await fetch_media(ref_audio, max_bytes=MAX_BYTES, field="ref_audio")
    text = (ref_text.strip() or None) if isinstance(ref_text, str) else None
    try:
        return await anyio.to_thread.run_sync(lambda: decode_reference(data, text=text))
    except AudioError as err:
        raise RequestError(err.field, err.message, err.status) from None
