"""Canary's deployment knobs and request options."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Knobs, RequestKnobs


class CanaryKnobs(Knobs):
    """Canary's ``model_kwargs`` (eager torch, the paged reference attention)."""

    max_audio_seconds: float = Field(1800.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds of audio; longer than ``max_clip_seconds``, it is cut into
    windows at quiet points."""

    max_clip_seconds: float = Field(40.96, gt=0, allow_inf_nan=False)
    """The longest window one request decodes, in seconds."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    max_new_tokens: int = Field(256, ge=1)
    """Tokens a window may decode."""


class CanaryRequestKnobs(RequestKnobs):
    """The options of a Canary request (``/generate``'s ``model_kwargs``, and the extra fields
    of the OpenAI routes)."""

    language: str | None = None
    """The speech's language (one of the 25; default en)."""

    target_language: str | None = None
    """The transcript's language: the speech's (transcription, the default), or another for a
    translation to or from English."""

    punctuation: bool = True
    """Punctuation and capitalisation."""
