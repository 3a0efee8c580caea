"""Response formats of a Transcription: json, text, verbose_json, srt, vtt."""

from __future__ import annotations

import json
import re

import pytest

from mstar.audio.formats import (
    RESPONSE_FORMATS,
    format_timestamp,
    language_code,
    language_name,
    render_transcription,
)
from mstar.contract import Transcription, TranscriptionSegment

SEGMENTS = [
    TranscriptionSegment(id=0, start=0.0, end=2.5, text=" Hello there.", tokens=[1, 2]),
    TranscriptionSegment(id=1, start=2.5, end=3725.0456, text=" Bye --> now.\n\nreally"),
]
T = Transcription(text="Hello there. Bye now.", language="en", duration=3726.0, segments=SEGMENTS)

_SRT_TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2}),(\d{3}) --> (\d{2}):(\d{2}):(\d{2}),(\d{3})$")
_VTT_TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2})\.(\d{3}) --> (\d{2}):(\d{2}):(\d{2})\.(\d{3})$")


def _seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def _cue_times(body: str, pattern: re.Pattern[str]) -> list[tuple[float, float]]:
    out = []
    for line in body.splitlines():
        match = pattern.match(line)
        if match:
            g = match.groups()
            out.append((_seconds(*g[:4]), _seconds(*g[4:])))
    return out


def test_json_and_text() -> None:
    body, media = render_transcription(T, "json")
    assert json.loads(body) == {"text": T.text} and media == "application/json"
    body, media = render_transcription(T, "text")
    assert body == T.text + "\n" and media.startswith("text/plain")


def test_verbose_json() -> None:
    body, media = render_transcription(T, "verbose_json", task="translate")
    out = json.loads(body)
    assert media == "application/json"
    assert set(out) == {"task", "language", "duration", "text", "segments"}
    assert (out["task"], out["language"], out["duration"]) == ("translate", "english", 3726.0)
    keys = {"id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
            "compression_ratio", "no_speech_prob"}  # fmt: skip
    assert all(set(s) == keys for s in out["segments"])
    assert out["segments"][0]["tokens"] == [1, 2] and out["segments"][1]["seek"] == 250


def test_srt() -> None:
    body, _ = render_transcription(T, "srt")
    blocks = body.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["1", "2"]  # 1-based cue numbers
    assert _cue_times(body, _SRT_TIME) == [(0.0, 2.5), (2.5, 3725.046)]
    assert "01:02:05,046" in body
    assert blocks[0].splitlines()[2] == "Hello there."
    assert blocks[1].splitlines()[2:] == ["Bye -> now.", "really"]  # no arrow, no blank line


def test_vtt() -> None:
    body, media = render_transcription(T, "vtt")
    assert body.startswith("WEBVTT\n\n") and media.startswith("text/vtt")
    assert _cue_times(body, _VTT_TIME) == [(0.0, 2.5), (2.5, 3725.046)]
    assert "-->" not in body.replace(" --> ", "")


def test_subtitles_without_segments() -> None:
    bare = Transcription(text="Just text.", language="fr", duration=4.0)
    assert _cue_times(render_transcription(bare, "srt")[0], _SRT_TIME) == [(0.0, 4.0)]
    empty = Transcription(text="", language="en", duration=1.0)
    assert render_transcription(empty, "srt")[0] == ""
    assert render_transcription(empty, "vtt")[0].strip() == "WEBVTT"


def test_timestamps_and_languages() -> None:
    assert format_timestamp(0) == "00:00:00,000"
    assert format_timestamp(59.9996, ".") == "00:01:00.000"
    assert format_timestamp(-1) == "00:00:00,000"
    assert language_name("en") == "english" and language_name("xx") == "xx"
    assert language_code("English") == "en" and language_code("DE") == "de"
    assert language_code("Mandarin") == "zh"


def test_unknown_format() -> None:
    assert set(RESPONSE_FORMATS) == {"json", "text", "srt", "verbose_json", "vtt"}
    with pytest.raises(ValueError, match="response_format"):
        render_transcription(T, "diarized_json")
