"""Whisper's request path over its segment scores: the temperature fallback and the silence
skip of OpenAI's ``whisper.transcribe`` (``decode_with_fallback``, ``should_skip``), the
compression ratio, the prompt that stops at SOT, and the scores crossing the output stream.

The walks are answered by a fake ``run`` that gives each temperature the scores a test sets;
the spec is a ``whisper`` deployment on a tiny directory (benchmarks.common) with no weights.
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import soundfile as sf
import torch

from mstar.config import parse_config
from mstar.contract import TranscriptionSpec
from mstar.model.spec import WalkOutput, WalkRequest
from mstar.model.whisper import model as whisper_model
from mstar.model.whisper.model import Decoded, Whisper, WhisperStream, compression_ratio

GOOD = " The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Whisper:
    from benchmarks.common import WHISPER_TINY, whisper_dir

    path = str(whisper_dir(tmp_path_factory.mktemp("whisper"), **WHISPER_TINY))
    spec = Whisper(parse_config({"model": "whisper", "model_path": path, "load_format": "dummy"}))
    spec.load_frontend()
    return spec


def wav(seconds: float = 2.0) -> bytes:
    samples = 0.1 * np.random.default_rng(0).standard_normal(int(16000 * seconds)).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, samples, 16000, format="WAV")
    return buffer.getvalue()


def fake_run(spec: Whisper, scores: dict[float, tuple[float, float]], texts: dict[float, str] | None = None):
    """A ``run`` answering the walk at temperature ``t`` with ``texts[t]`` (else GOOD) and
    ``scores[t]`` (avg_logprob, no_speech_prob); it records the temperatures asked for."""
    asked: list[float] = []

    async def run(request: WalkRequest) -> WalkOutput:
        temperature = request.params["sampling"]["temperature"]
        asked.append(temperature)
        text = (texts or {}).get(temperature, GOOD)
        ids = [*request.params["forced_ids"], *spec.tokens.tokenizer.encode(text, add_special_tokens=False),
               spec.tokens.eot]
        data = np.array(scores[temperature], dtype=np.float64).tobytes()
        return WalkOutput(text, ids, {"scores": data})

    return run, asked


def transcribe(spec: Whisper, run, temperature: float | None = None):
    request = TranscriptionSpec("r", wav(), "clip.wav", language="en", temperature=temperature)
    return asyncio.run(spec.transcribe(request, run))


TEMPERATURES = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_a_confident_segment_is_decoded_once_with_its_scores(spec: Whisper) -> None:
    run, asked = fake_run(spec, {0.0: (-0.25, 0.01)})
    result = transcribe(spec, run)
    assert asked == [0.0]
    (segment,) = result.segments
    assert (segment.avg_logprob, segment.no_speech_prob, segment.temperature) == (-0.25, 0.01, 0.0)
    assert segment.compression_ratio == pytest.approx(compression_ratio(GOOD.strip())) and segment.compression_ratio > 0
    assert result.text == GOOD.strip()


def test_a_low_logprob_falls_back_until_a_temperature_is_confident(spec: Whisper) -> None:
    run, asked = fake_run(spec, {0.0: (-1.5, 0.01), 0.2: (-1.01, 0.01), 0.4: (-0.9, 0.01)})
    (segment,) = transcribe(spec, run).segments
    assert asked == [0.0, 0.2, 0.4] and segment.temperature == 0.4 and segment.avg_logprob == -0.9


def test_a_segment_that_never_passes_keeps_the_last_temperature(spec: Whisper) -> None:
    run, asked = fake_run(spec, {t: (-2.0, 0.1) for t in TEMPERATURES})
    (segment,) = transcribe(spec, run).segments
    assert asked == TEMPERATURES and segment.temperature == 1.0


def test_a_repetitive_text_falls_back(spec: Whisper, monkeypatch) -> None:
    loop = " la" * 60
    assert compression_ratio(loop.strip()) > whisper_model.MAX_COMPRESSION_RATIO
    run, asked = fake_run(spec, {t: (-0.1, 0.01) for t in TEMPERATURES}, texts={0.0: loop, 0.2: loop})
    (segment,) = transcribe(spec, run).segments
    assert asked == [0.0, 0.2, 0.4] and segment.text == GOOD
    # the threshold decides: lowered under the good text's ratio, every temperature is tried
    monkeypatch.setattr(whisper_model, "MAX_COMPRESSION_RATIO", 0.5)
    run, asked = fake_run(spec, {t: (-0.1, 0.01) for t in TEMPERATURES})
    transcribe(spec, run)
    assert asked == TEMPERATURES


def test_the_logprob_threshold_decides(spec: Whisper, monkeypatch) -> None:
    monkeypatch.setattr(whisper_model, "MIN_AVG_LOGPROB", -0.1)
    run, asked = fake_run(spec, {t: (-0.25, 0.01) for t in TEMPERATURES})
    transcribe(spec, run)
    assert asked == TEMPERATURES
    monkeypatch.setattr(whisper_model, "MIN_AVG_LOGPROB", -1.0)
    run, asked = fake_run(spec, {t: (-0.25, 0.01) for t in TEMPERATURES})
    transcribe(spec, run)
    assert asked == [0.0]


def test_silence_is_not_decoded_again_and_is_left_out(spec: Whisper) -> None:
    run, asked = fake_run(spec, {0.0: (-1.5, 0.9)})
    result = transcribe(spec, run)
    assert asked == [0.0] and result.segments == [] and result.text == ""
    # likely silence but a confident decoder: kept (the reference's should_skip is False)
    run, asked = fake_run(spec, {0.0: (-0.5, 0.9)})
    result = transcribe(spec, run)
    assert asked == [0.0] and len(result.segments) == 1 and result.segments[0].no_speech_prob == 0.9


def test_a_fixed_temperature_is_not_fallen_back_from(spec: Whisper) -> None:
    run, asked = fake_run(spec, {0.3: (-3.0, 0.01)})
    (segment,) = transcribe(spec, run, temperature=0.3).segments
    assert asked == [0.3] and segment.avg_logprob == -3.0


def test_decoded_follows_decode_with_fallback() -> None:
    def decoded(avg: float, no_speech: float, text: str = GOOD) -> Decoded:
        scores = np.array([avg, no_speech], dtype=np.float64).tobytes()
        return Decoded.of(WalkOutput(text, [], {"scores": scores}), 0.0)

    assert not decoded(-0.5, 0.1).needs_fallback
    assert decoded(-1.01, 0.1).needs_fallback
    assert not decoded(-1.01, 0.61).needs_fallback and decoded(-1.01, 0.61).silence
    # at -1 exactly: not below the threshold (no fallback), not above it (skipped as silence)
    assert decoded(-1.0, 0.61).silence and not decoded(-1.0, 0.61).needs_fallback
    assert not decoded(-0.99, 0.99).silence
    assert decoded(-0.5, 0.1, " la" * 60).needs_fallback


def test_the_prompt_stops_at_sot_and_the_task_tokens_are_forced(spec: Whisper) -> None:
    tokens = spec.tokens
    given = spec.window_request(torch.zeros(16000), "en", "transcribe", "a prompt", 0.0, 0)
    full = tokens.prompt_ids("en", "transcribe", "a prompt")
    assert given.inputs["prompt_ids"].tolist() == full[:-3] and full[-4] == tokens.sot
    assert given.params["forced_ids"] == full[-3:] and not given.params["detect_language"]
    detect = spec.window_request(torch.zeros(16000), None, "transcribe", None, 0.0, 0)
    assert detect.inputs["prompt_ids"].tolist() == [tokens.sot]
    assert detect.params["forced_ids"] == [] and detect.params["detect_language"]
    assert given.params["max_new_tokens"] == detect.params["max_new_tokens"] == spec.max_new_tokens + 3


def test_the_stream_sends_the_scores_as_data(spec: Whisper) -> None:
    stream = WhisperStream(spec.tokens)
    event = stream.feed("scores", torch.tensor([-0.5, 0.25]))
    assert event.modality == "scores" and np.frombuffer(event.data, dtype=np.float64).tolist() == [-0.5, 0.25]
    assert stream.generated == 0


def test_compression_ratio_is_openai_s() -> None:
    import zlib

    text = "hello hello hello hello"
    assert compression_ratio(text) == len(text.encode()) / len(zlib.compress(text.encode()))
    assert compression_ratio("") == 0.0


def test_a_long_upload_runs_at_most_max_concurrent_requests_windows_at_once(tmp_path) -> None:
    """Its windows wait in the request, not in the admission queue: 20+ windows on a deployment
    that admits 2 requests (and queues 8) would otherwise overflow the queue by themselves."""
    from benchmarks.common import WHISPER_TINY, whisper_dir

    path = str(whisper_dir(tmp_path, **WHISPER_TINY))
    small = Whisper(parse_config({"model": "whisper", "model_path": path, "load_format": "dummy",
                                  "max_concurrent_requests": 2, "model_kwargs": {"max_audio_seconds": 900}}))
    small.load_frontend()
    answer, _ = fake_run(small, {0.0: (-0.2, 0.01)})
    running = peak = 0

    async def run(request: WalkRequest) -> WalkOutput:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return await answer(request)

    request = TranscriptionSpec("long", wav(600.0), "clip.wav", language="en")
    result = asyncio.run(small.transcribe(request, run))
    assert len(result.segments) >= 20 and peak == 2  # windows cut at quiet points, up to 30 s each
