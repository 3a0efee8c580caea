"""AudioEncoder: every response format from float32 chunks, streamed and whole."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf

from mstar.audio.encode import (
    AudioEncoder,
    check_format,
    encode_audio,
    float_to_pcm16,
    mp3_supported,
    supported_formats,
    wav_header,
)
from mstar.audio.io import AudioError

RATE = 24000


def _sine(seconds: float = 0.5, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _feed_all(encoder: AudioEncoder, samples: np.ndarray, parts: int = 3) -> list[bytes]:
    outs = [encoder.feed(chunk.tobytes()) for chunk in np.array_split(samples, parts)]
    return [*outs, encoder.finish()]


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def test_float_to_pcm16_clips_and_rounds() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, np.nan], dtype=np.float32)
    pcm = np.frombuffer(float_to_pcm16(x), dtype="<i2")
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]


def test_wav_whole_file_has_exact_sizes() -> None:
    x = _sine()
    outs = _feed_all(AudioEncoder("wav", RATE), x)
    assert outs[:-1] == [b"", b"", b""]  # held back until the sizes are known
    wav = outs[-1]
    assert struct.unpack_from("<I", wav, 4)[0] == len(wav) - 8
    assert struct.unpack_from("<I", wav, 40)[0] == len(wav) - 44 == 2 * len(x)
    y, rate = _decode(wav)
    assert rate == RATE and len(y) == len(x)
    np.testing.assert_allclose(y, x, atol=2 / 32768)


def test_wav_stream_header_first_with_unknown_length() -> None:
    x = _sine()
    outs = _feed_all(AudioEncoder("wav", RATE, streaming=True), x)
    assert outs[0][:4] == b"RIFF" and all(o[:4] != b"RIFF" for o in outs[1:])
    assert struct.unpack_from("<I", outs[0], 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", outs[0], 40)[0] == 0xFFFFFFFF
    assert outs[-1] == b""
    y, rate = _decode(b"".join(outs))
    assert rate == RATE and len(y) == len(x)
    np.testing.assert_allclose(y, x, atol=2 / 32768)


def test_wav_stream_without_audio_is_still_a_header() -> None:
    encoder = AudioEncoder("wav", RATE, streaming=True)
    assert encoder.finish() == wav_header(RATE, None)


def test_pcm_is_raw_int16_as_it_comes() -> None:
    x = _sine()
    outs = _feed_all(AudioEncoder("pcm", RATE, streaming=True), x)
    assert all(outs[:-1]) and outs[-1] == b""
    pcm = np.frombuffer(b"".join(outs), dtype="<i2")
    np.testing.assert_array_equal(pcm, np.rint(x * 32767).astype(np.int16))


def test_samples_split_across_chunks_are_joined() -> None:
    x = _sine(0.01)
    raw = x.tobytes()
    encoder = AudioEncoder("pcm", RATE)
    out = encoder.feed(raw[:5]) + encoder.feed(raw[5:11]) + encoder.feed(raw[11:])
    assert out == float_to_pcm16(x)


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_compressed_formats(fmt: str) -> None:
    if fmt == "mp3" and not mp3_supported():
        pytest.skip("this libsndfile cannot write MP3")
    x = _sine(1.0)
    outs = _feed_all(AudioEncoder(fmt, RATE, streaming=True), x)
    assert outs[:-1] == [b"", b"", b""]  # encoded once, at the end
    y, rate = _decode(outs[-1])
    assert rate == RATE
    if fmt == "flac":  # lossless up to PCM16 rounding
        np.testing.assert_allclose(y, x, atol=2 / 32768)
    else:  # lossy, and the decoder may pad: compare the energy
        assert abs(len(y) - len(x)) < RATE // 10
        assert np.sqrt(np.mean(y**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "wav"])
def test_empty_audio_is_a_valid_file(fmt: str) -> None:
    if fmt == "mp3" and not mp3_supported():
        pytest.skip("this libsndfile cannot write MP3")
    data = encode_audio(np.zeros(0, dtype=np.float32), fmt, RATE)
    assert sf.info(io.BytesIO(data)).samplerate == RATE


def test_unsupported_and_unknown_formats_name_the_field() -> None:
    for fmt in ("opus", "aac"):
        with pytest.raises(AudioError, match="not supported") as err:
            AudioEncoder(fmt, RATE)
        assert err.value.field == "response_format" and err.value.status == 400
    with pytest.raises(AudioError, match="'ogg' is not a known audio format") as err:
        check_format("ogg")
    assert "wav, pcm, flac" in err.value.message
    assert set(supported_formats()) >= {"wav", "pcm", "flac"}
