"""End to end: the real ``mstar serve whisper_base`` CLI in a subprocess, over HTTP.

One server for the module (worker processes, CPU, fp32, the embedded CTranslate2 weights),
started with a deployment YAML that lowers ``model_kwargs.max_audio_seconds`` to 60 s so
that an over-long upload is cheap to build. It speaks OpenAI's speech-to-text API to the
official ``openai`` client and to raw httpx, the M* SDK and /generate. The spoken clip
(espeak-ng, 8.7 s) must be recognised with a low word error rate; long audio (built here
from the clip) is cut into 30-second windows; bad uploads get a 4xx naming the problem.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import Server, launch_server

from mstar.client import MStarClient

MODEL = "whisper_base"
DATA = Path(__file__).resolve().parents[1] / "data"
CLIP = DATA / "speech_en.wav"
REFERENCE = (DATA / "speech_en.txt").read_text().strip()
MAX_AUDIO_S = 60
MAX_WER = 0.15
REQUEST_TIMEOUT_S = 120.0


# ----------------------------------------------------------------- helpers


def normalize_words(text: str) -> list[str]:
    """Lowercase words with punctuation stripped (apostrophes inside words kept)."""
    text = re.sub(r"[^\w\s']", " ", text.lower())
    return [w.strip("'") for w in text.split() if w.strip("'")]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words: Levenshtein over words."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / len(ref)


def test_word_error_rate_helper() -> None:
    assert word_error_rate("The cat sat.", "the cat sat") == 0.0
    assert word_error_rate("a b c d", "a x c d") == 0.25  # one substitution
    assert word_error_rate("a b c d", "a c d") == 0.25  # one deletion
    assert word_error_rate("a b c d", "a b b c d") == 0.25  # one insertion
    assert word_error_rate("Don't stop!", "don't, STOP") == 0.0


def _wav(audio: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _clip_at(starts_s: list[float]) -> tuple[bytes, float]:
    """Copies of the clip starting at ``starts_s`` (silence between), as a WAV; its length."""
    samples, rate = sf.read(CLIP, dtype="float32")
    length = int(round(starts_s[-1] * rate)) + len(samples)
    audio = np.zeros(length, dtype=np.float32)
    for start in starts_s:
        at = int(round(start * rate))
        audio[at:at + len(samples)] = samples
    return _wav(audio, rate), length / rate


def _repeated_clip(copies: int, gap_s: float = 0.5) -> tuple[bytes, float]:
    """The clip ``copies`` times with ``gap_s`` of silence between, as a WAV; its length."""
    step = sf.info(CLIP).duration + gap_s
    return _clip_at([i * step for i in range(copies)])


_TIME = r"(\d{2}):(\d{2}):(\d{2})[,.](\d{3})"


def _seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def parse_cues(body: str, decimal: str) -> list[tuple[float, float, str]]:
    """``(start, end, text)`` of every cue of an SRT (``decimal=","``, numbered cues) or
    WebVTT (``decimal="."``, after the ``WEBVTT`` header) body; asserts the layout."""
    blocks = [b for b in re.split(r"\n\s*\n", body.strip()) if b.strip()]
    if decimal == ".":
        assert blocks and blocks[0].splitlines()[0] == "WEBVTT", body
        blocks = blocks[1:]
    arrow = re.compile(rf"^{_TIME.replace('[,.]', re.escape(decimal))} --> "
                       rf"{_TIME.replace('[,.]', re.escape(decimal))}$")
    cues = []
    for n, block in enumerate(blocks, start=1):
        lines = block.splitlines()
        if decimal == ",":
            assert lines[0] == str(n), f"SRT cue {n} is numbered {lines[0]!r}"
            lines = lines[1:]
        match = arrow.match(lines[0])
        assert match, f"not a cue timing line: {lines[0]!r}"
        g = match.groups()
        start, end = _seconds(*g[:4]), _seconds(*g[4:])
        text = "\n".join(lines[1:]).strip()
        assert 0 <= start < end and text, block
        cues.append((start, end, text))
    return cues


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("whisper-server")
    config = workdir / "whisper.yaml"
    config.write_text(f"model: {MODEL}\nmodel_kwargs:\n  max_audio_seconds: {MAX_AUDIO_S}\n")
    with launch_server(MODEL, workdir, ["--config", str(config)]) as live:
        yield live


@pytest.fixture(scope="module")
def wav() -> bytes:
    return CLIP.read_bytes()


@pytest.fixture(scope="module")
def baseline(oai: openai.OpenAI) -> str:
    """The clip's transcript (json format, language detected): what later requests match."""
    with open(CLIP, "rb") as f:
        return oai.audio.transcriptions.create(model=MODEL, file=f).text


def _transcribe(http: httpx.Client, audio: bytes, filename: str = "clip.wav", route: str = "transcriptions",
                **fields: str) -> httpx.Response:
    return http.post(f"/v1/audio/{route}", data={"model": MODEL, **fields},
                     files={"file": (filename, audio, "application/octet-stream")})


# ---------------------------------------------------------------- accuracy


def test_models_lists_whisper(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert MODEL in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_openai_client_transcription_wer(baseline: str) -> None:
    wer = word_error_rate(REFERENCE, baseline)
    print(f"\nWER {wer:.3f}: {baseline!r}")
    assert wer <= MAX_WER, (wer, baseline)


def test_forced_english(oai: openai.OpenAI, baseline: str) -> None:
    with open(CLIP, "rb") as f:
        result = oai.audio.transcriptions.create(model=MODEL, file=f, language="en")
    assert word_error_rate(REFERENCE, result.text) <= MAX_WER, result.text
    assert result.text == baseline  # detection picks English: the same prompt, the same greedy text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client flags translations
def test_translation_is_english(oai: openai.OpenAI) -> None:
    with open(CLIP, "rb") as f:
        result = oai.audio.translations.create(model=MODEL, file=f)
    assert result.text.isascii() and result.text.strip(), result.text
    assert word_error_rate(REFERENCE, result.text) <= 0.3, result.text


def test_prompt_is_accepted(oai: openai.OpenAI) -> None:
    with open(CLIP, "rb") as f:
        result = oai.audio.transcriptions.create(model=MODEL, file=f, prompt="A pangram, then a sentence.")
    assert word_error_rate(REFERENCE, result.text) <= MAX_WER, result.text


# ---------------------------------------------------------- response formats


def test_text_format(oai: openai.OpenAI, baseline: str) -> None:
    with open(CLIP, "rb") as f:
        body = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="text")
    assert isinstance(body, str)
    assert body.strip() == baseline


def test_srt_format(oai: openai.OpenAI, baseline: str) -> None:
    with open(CLIP, "rb") as f:
        body = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="srt")
    cues = parse_cues(body, ",")
    assert cues[0][0] == 0.0 and cues[-1][1] == pytest.approx(8.658, abs=0.002)
    assert " ".join(text for _, _, text in cues) == baseline


def test_vtt_format(http: httpx.Client, wav: bytes, baseline: str) -> None:
    response = _transcribe(http, wav, response_format="vtt")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/vtt")
    cues = parse_cues(response.text, ".")
    assert cues[0][0] == 0.0 and cues[-1][1] == pytest.approx(8.658, abs=0.002)
    assert " ".join(text for _, _, text in cues) == baseline


def test_verbose_json_format(oai: openai.OpenAI, baseline: str) -> None:
    with open(CLIP, "rb") as f:
        result = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="verbose_json")
    assert result.language == "english"
    assert result.duration == pytest.approx(8.658, abs=0.01)
    assert result.text == baseline
    segments = result.segments
    assert segments and segments[0].start == 0.0
    assert segments[-1].end == pytest.approx(result.duration, abs=0.01)
    for a, b in zip(segments, segments[1:]):
        assert a.end == pytest.approx(b.start)
    assert all(s.start < s.end and s.text.strip() and s.tokens for s in segments)
    assert "".join(s.text for s in segments).strip() == baseline
    for s in segments:  # OpenAI's statistics of a clearly spoken, confidently decoded clip
        print(f"\nsegment {s.id}: avg_logprob {s.avg_logprob:.3f}, no_speech_prob {s.no_speech_prob:.2e}, "
              f"compression_ratio {s.compression_ratio:.3f}, temperature {s.temperature}")
        assert -1.0 < s.avg_logprob < 0.0 and 0.0 < s.no_speech_prob < 0.6
        assert 0.5 < s.compression_ratio <= 2.4 and s.temperature == 0.0


# ------------------------------------------------------------ SDK, /generate


def test_sdk_transcribe(server: Server, wav: bytes, baseline: str) -> None:
    with MStarClient(server.url, timeout=REQUEST_TIMEOUT_S) as sdk:
        by_path = sdk.transcribe(CLIP)
        verbose = sdk.transcribe(wav, filename="clip.wav", response_format="verbose_json", language="en")
        translated = sdk.transcribe(CLIP, translate=True)
    print(f"\ntranslation: {translated.text!r}")
    assert by_path.text == baseline
    assert verbose.text == baseline and verbose.language == "english"
    assert verbose.duration == pytest.approx(8.658, abs=0.01) and verbose.segments
    assert word_error_rate(REFERENCE, translated.text) <= 0.3, translated.text


def test_generate_with_audio_file(http: httpx.Client, wav: bytes, baseline: str) -> None:
    response = http.post("/generate", files=[("files", ("clip.wav", wav, "audio/wav"))])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"].strip() == baseline
    assert body["finish_reason"] == "stop"
    forced = http.post("/generate", data={"model_kwargs": json.dumps({"language": "en", "temperature": 0})},
                       files=[("files", ("clip.wav", wav, "audio/wav"))])
    assert forced.status_code == 200, forced.text
    assert forced.json()["text"].strip() == baseline


@pytest.mark.parametrize("options,param", [({"task": "summarise"}, "task"), ({"lang": "en"}, "model_kwargs"),
                                           ({"temperature": -1}, "temperature")])
def test_generate_options_are_typed(http: httpx.Client, wav: bytes, options: dict, param: str) -> None:
    """/generate's transcription options (``TranscribeKnobs``): a bad or unknown one is a 400
    naming it, before the audio is decoded."""
    response = http.post("/generate", data={"model_kwargs": json.dumps(options)},
                         files=[("files", ("clip.wav", wav, "audio/wav"))])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_generate_bad_audio_is_400(http: httpx.Client) -> None:
    response = http.post("/generate", files=[("files", ("clip.wav", b"not audio at all" * 64, "audio/wav"))])
    assert response.status_code == 400, response.text
    assert "decode" in response.json()["error"]["message"]


# ----------------------------------------------------------------- long audio


# The clip (8.66 s) ends in 0.55 s of digital silence and has 15-65 ms of exact zeros in
# its stop closures. The second copy starts at 18 s, so the first window's cut search span
# (25-30 s) holds some of those closures (from 25.3 s), then the pause after the copy
# (26.1-31 s): the cut must go into the pause, not into a closure inside "words into text".
# Each window holds two copies: three identical sentences in one window would compress
# too well and send Whisper through its temperature fallbacks.
LONG_STARTS_S = [0.0, 18.0, 31.0, 41.0]
PAUSE_S = (18.0 + 8.11, 31.0)


def test_long_audio_is_windowed(http: httpx.Client) -> None:
    audio, duration = _clip_at(LONG_STARTS_S)
    assert 49 < duration < 50
    response = _transcribe(http, audio, "long.wav", response_format="verbose_json")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["duration"] == pytest.approx(duration, abs=0.01)
    segments = body["segments"]
    assert len(segments) == 2, segments
    assert segments[0]["start"] == 0.0
    assert segments[-1]["end"] == pytest.approx(duration, abs=0.01)
    for a, b in zip(segments, segments[1:]):
        assert a["end"] == pytest.approx(b["start"]), (a, b)
    assert all(s["end"] - s["start"] <= 30.0 + 1e-6 for s in segments)
    assert PAUSE_S[0] < segments[0]["end"] < PAUSE_S[1], "the window was not cut in the pause"
    for segment in segments:
        words = " ".join(normalize_words(segment["text"]))
        assert words.count("quick brown fox") == 2, segment
        assert words.count("spoken words into text") == 2, segment
        assert segment["temperature"] == 0.0, segment
    words = " ".join(normalize_words(body["text"]))
    assert words.count("speech recognition") == len(LONG_STARTS_S), body["text"]


# ------------------------------------------------------------------ bad input


_MP4 = (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41"
        b"\x00\x00\x00\x08free\x00\x00\x00\x08mdat")
BAD_INPUTS = {
    # name: (file bytes or a builder, extra form fields, status, param, words in the message)
    "corrupt": (lambda: np.random.default_rng(0).bytes(4096), {}, 400, "file", ["decode"]),
    "empty": (b"", {}, 400, "file", ["empty"]),
    "video": (_MP4, {}, 400, "file", ["video"]),
    "too_long": (lambda: _repeated_clip(8)[0], {}, 400, "file", ["limit", f"{MAX_AUDIO_S} s"]),
    "language": (None, {"language": "xx"}, 400, "language", ["language", "'xx'"]),
    "response_format": (None, {"response_format": "mp3"}, 400, "response_format", ["response_format", "mp3"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(http: httpx.Client, wav: bytes, case: str) -> None:
    audio, fields, status, param, words = BAD_INPUTS[case]
    if audio is None:
        audio = wav
    elif callable(audio):
        audio = audio()
    response = _transcribe(http, audio, f"{case}.wav", **fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error


def test_bad_input_is_typed_in_openai_client(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.audio.transcriptions.create(model=MODEL, file=("video.mp4", _MP4))
    assert info.value.status_code == 400 and "video" in info.value.body["message"]


def test_still_serves_after_bad_input(oai: openai.OpenAI, server: Server, baseline: str) -> None:
    with open(CLIP, "rb") as f:
        assert oai.audio.transcriptions.create(model=MODEL, file=f).text == baseline
    assert server.proc.poll() is None
