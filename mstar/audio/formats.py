"""Rendering a ``Transcription`` in OpenAI's response formats, and language names.

``render_transcription(t, fmt)`` gives ``(body, media_type)`` for the formats of
/v1/audio/transcriptions: ``json`` (``{"text"}``), ``text``, ``verbose_json`` (OpenAI's
shape with segments), ``srt`` and ``vtt`` subtitles.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mstar.audio.languages import CODE_OF_NAME, LANGUAGES
from mstar.contract import Transcription, TranscriptionSegment

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


def language_name(code: str) -> str:
    """The English name OpenAI reports for ``code`` ("en" -> "english"); else ``code``."""
    return LANGUAGES.get(code.lower(), code)


def language_code(value: str) -> str:
    """A language given as a code or an English name ("English") as its code ("en");
    anything unrecognised is returned lowercased, for the backend to judge."""
    key = value.strip().lower()
    return CODE_OF_NAME.get(key, key)


# ------------------------------------------------------------------ subtitles


def format_timestamp(seconds: float, decimal: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SRT) or, with ``decimal="."``, ``HH:MM:SS.mmm`` (WebVTT)."""
    ms = max(int(round(seconds * 1000)), 0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _cue_text(text: str) -> str:
    """Segment text safe inside a cue: no blank lines (they end a cue), no arrows."""
    text = text.strip().replace("-->", "->")
    return re.sub(r"\n\s*\n+", "\n", text)


def _cues(t: Transcription) -> list[TranscriptionSegment]:
    if t.segments:
        return t.segments
    if not t.text.strip():
        return []
    return [TranscriptionSegment(id=0, start=0.0, end=t.duration, text=t.text)]


def to_srt(t: Transcription) -> str:
    blocks = [
        f"{i}\n{format_timestamp(s.start)} --> {format_timestamp(s.end)}\n{_cue_text(s.text)}\n"
        for i, s in enumerate(_cues(t), start=1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcription) -> str:
    blocks = [
        f"{format_timestamp(s.start, '.')} --> {format_timestamp(s.end, '.')}\n"
        f"{_cue_text(s.text)}\n"
        for s in _cues(t)
    ]
    return "\n".join(["WEBVTT\n", *blocks])


# ----------------------------------------------------------------------- JSON


def _segment(s: TranscriptionSegment) -> dict:
    return {
        "id": s.id,
        "seek": int(round(s.start * 100)),  # Whisper's unit: 10-ms feature frames
        "start": s.start,
        "end": s.end,
        "text": s.text,
        "tokens": list(s.tokens),
        "temperature": s.temperature,
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    }


def to_verbose_json(t: Transcription, task: str = "transcribe") -> dict:
    """OpenAI's ``verbose_json`` object."""
    return {
        "task": task,
        "language": language_name(t.language),
        "duration": t.duration,
        "text": t.text,
        "segments": [_segment(s) for s in t.segments],
    }


_JSON = "application/json"
_RENDERERS: dict[str, Callable[[Transcription, str], tuple[str, str]]] = {
    "json": lambda t, _: (json.dumps({"text": t.text}), _JSON),
    "verbose_json": lambda t, task: (json.dumps(to_verbose_json(t, task)), _JSON),
    "text": lambda t, _: (t.text + "\n", "text/plain; charset=utf-8"),
    "srt": lambda t, _: (to_srt(t), "text/plain; charset=utf-8"),
    "vtt": lambda t, _: (to_vtt(t), "text/vtt; charset=utf-8"),
}


def render_transcription(
    t: Transcription, response_format: str = "json", task: str = "transcribe"
) -> tuple[str, str]:
    """``(body, media_type)`` of ``t`` in ``response_format`` (one of RESPONSE_FORMATS)."""
    try:
        render = _RENDERERS[response_format]
    except KeyError:
        raise ValueError(
            f"unknown response_format {response_format!r}; use one of {', '.join(RESPONSE_FORMATS)}"
        ) from None
    return render(t, task)
