"""Fish S2-Pro served in process (CPU, fp32, a tiny release's configs and tokenizer with
``load_format: dummy`` weights) through the official ``openai`` client: plain and streamed
speech (the stream joins to the whole), /generate's audio equal to the eager loop's frames
decoded whole, cloning from a WAV data URI with its ``ref_text``,
``[tag]`` prosody passed through to the prompt, 8 concurrent seeded requests equal to their
solo audio, 400s naming ``ref_audio``, ``ref_text``, ``speed`` and an unknown option, a
client that hangs up mid-stream giving back every KV page and codec stream, and the shared
conditioning cache: a clip sent again (whatever its transcript) is not encoded again and
speaks the same audio, the memo evicts by bytes, and presets of ``voices_dir`` are listed by
/v1/audio/voices and spoken as an upload of their clip and transcript is."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from client_hangup import hang_up_when
from live_server import Uvicorn

from mstar.config import parse_config
from mstar.contract import RequestError, SpeechSpec
from mstar.model.fish_s2_pro.checkpoint import FishS2ProCheckpoint
from mstar.model.fish_s2_pro.generate import Sampling, generate
from mstar.model.voice_cloning import ClipMemo
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.fish_s2_pro import RATE, SAMPLES_PER_FRAME, write_release

MODEL = "fish_s2_pro"
FRAMES = 12
REQUEST_TIMEOUT_S = 60.0


def clip_wav(seconds: float = 0.3, rate: int = 16000, pitch: float = 150.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.1 * np.sin(2 * np.pi * pitch * t) + 0.01 * np.random.default_rng(int(pitch)).standard_normal(t.size)
    out = io.BytesIO()
    sf.write(out, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory):
    return write_release(tmp_path_factory.mktemp("fish_s2_pro"))


PRESET_TEXT = "A preset clip."
SHORT = {"max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def voices(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("fish_voices")
    (directory / "anna.wav").write_bytes(clip_wav(pitch=260.0))
    (directory / "anna.txt").write_text(PRESET_TEXT + "\n")
    (directory / "mute.wav").write_bytes(clip_wav(pitch=90.0))  # no transcript: unusable for S2-Pro
    return directory


@pytest.fixture(scope="module")
def deployment(release, voices):
    running = start(parse_config({
        "model": MODEL, "model_path": str(release), "device": "cpu", "dtype": "float32", "load_format": "dummy",
        "max_seq_len": 4608, "max_concurrent_requests": 8,
        "node_groups": [{"node_names": ["dual_ar", "codec"], "ranks": [0]}],
        "resources": {"kv_cache": {"max_num_pages": 2400, "page_size": 16}},
        "model_kwargs": {"max_new_frames": FRAMES, "codec_chunk_schedule": [1, 3], "codec_chunk_frames": 4,
                         "voices_dir": str(voices)}}),
        in_process=True)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def server(deployment) -> Iterator[Uvicorn]:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        yield live


def speak(oai: openai.OpenAI, text: str, fmt: str = "pcm", **extra) -> bytes:
    return oai.audio.speech.create(model=MODEL, voice="default", input=text, response_format=fmt,
                                   extra_body=extra).content


def test_speech_plain_and_streamed(oai: openai.OpenAI) -> None:
    audio = speak(oai, "Hello there.", fmt="wav", seed=3)
    samples, rate = sf.read(io.BytesIO(audio), dtype="int16")
    assert rate == RATE and samples.ndim == 1 and 0 < samples.size <= FRAMES * SAMPLES_PER_FRAME
    assert samples.size % SAMPLES_PER_FRAME == 0 and np.abs(samples).max() > 0
    whole = speak(oai, "Hello there.", seed=3)
    assert np.array_equal(np.frombuffer(whole, "<i2"), samples)
    with oai.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input="Hello there.", response_format="pcm",
            extra_body={"seed": 3, "stream": True}) as response:
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    assert b"".join(chunks) == whole
    assert speak(oai, "Hello there.", seed=4) != whole


@torch.no_grad()
def test_generate_equals_the_eager_loop_decoded_whole(http: httpx.Client, deployment, release) -> None:
    """/generate's float32 audio (seeded, fish-speech's sampling defaults) is ``generate.py``'s
    frames for the same prompt and seed, decoded whole: the engine's batched steps and the
    codec's streamed chunks change nothing."""
    options = {"seed": 21, "max_tokens": FRAMES}
    form = {"text": "Hello [laugh] there.", "output_modalities": "audio", "model_kwargs": json.dumps(options)}
    response = http.post("/generate", data=form)
    assert response.status_code == 200, response.text
    served = np.frombuffer(base64.b64decode(response.json()["data"]["audio"]), "<f4")
    inputs = deployment.spec.prepare_speech(SpeechSpec("e", "Hello [laugh] there.")).inputs
    ckpt = FishS2ProCheckpoint(release)
    model = ckpt.dual_ar(torch.device("cpu"), torch.float32, dummy=True, seed=0).eval()
    codec = ckpt.codec(torch.device("cpu"), dummy=True, seed=1, config=ckpt.codec_configs()[0]).eval()
    frames = generate(model, [(inputs["prompt_ids"], inputs["prompt_codes"])], max_frames=FRAMES,
                      sampling=Sampling(), seeds=[21], page_size=16)[0]
    assert len(frames) >= 4
    whole = codec.decode(frames.T[None])[0].numpy()
    assert served.shape == whole.shape
    assert np.abs(served - whole).max() <= 1e-5 * np.abs(whole).max()


def test_clones_from_a_wav_data_uri_with_its_transcript(oai: openai.OpenAI) -> None:
    clip = {"ref_audio": data_uri(clip_wav()), "ref_text": "A short clip.", "seed": 5}
    cloned = speak(oai, "Hello there.", **clip)
    assert len(cloned) > 0 and len(cloned) % (2 * SAMPLES_PER_FRAME) == 0
    assert speak(oai, "Hello there.", **clip) == cloned  # seeded, the clip's codes memoised
    assert speak(oai, "Hello there.", seed=5) != cloned  # the clip is in the prompt
    other = speak(oai, "Hello there.", **{**clip, "ref_audio": data_uri(clip_wav(pitch=300.0))})
    assert other != cloned


def test_tags_pass_through_to_the_prompt(oai: openai.OpenAI, deployment) -> None:
    spec = deployment.spec
    text = "[laugh] Hello [whisper] there"
    tokens = spec.prepare_speech(SpeechSpec("t", text)).inputs["prompt_ids"].tolist()
    tagged_ids = spec.tokenizer.encode(text, add_special_tokens=False)
    assert any(tokens[i:i + len(tagged_ids)] == tagged_ids for i in range(len(tokens)))  # the user turn, as sent
    tagged = speak(oai, "[laugh] Hello there.", seed=6)
    assert len(tagged) > 0 and tagged != speak(oai, "Hello there.", seed=6)


def test_concurrent_requests_equal_their_solo_audio(oai: openai.OpenAI) -> None:
    clip = data_uri(clip_wav(pitch=220.0))
    jobs = [dict(text=f"Sentence number {i}" + " and more" * (i % 3), seed=10 + i,
                 **({"ref_audio": clip, "ref_text": "A clip."} if i % 2 else {})) for i in range(8)]

    def run(job: dict) -> bytes:
        job = dict(job)
        return speak(oai, job.pop("text"), **job)

    alone = [run(job) for job in jobs]
    assert len(set(alone)) == 8
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, jobs))
    assert together == alone


@pytest.mark.parametrize(("extra", "field"), [
    ({"ref_audio": "CLIP"}, "ref_text"),
    ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(b"not audio at all").decode(),
      "ref_text": "words"}, "ref_audio"),
    ({"speed": 1.5}, "speed"),
    ({"min_p": 0.1}, "min_p"),
    ({"top_p": 0.0}, "top_p"),
])
def test_bad_requests_name_their_field(oai: openai.OpenAI, extra: dict, field: str) -> None:
    extra = dict(extra)
    if extra.get("ref_audio") == "CLIP":
        extra["ref_audio"] = data_uri(clip_wav())
    speed = extra.pop("speed", 1.0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.audio.speech.create(model=MODEL, voice="default", input="Hello.", response_format="pcm", speed=speed,
                                extra_body=extra)
    assert field in str(err.value)


def held(http: httpx.Client) -> tuple[float, float, float]:
    """KV pages of the dual AR, codec streams, and requests running or waiting."""
    text = http.get("/metrics").text
    pages = float(re.search(r'^mstar_kv_pages_used\{[^}]*node="dual_ar"[^}]*\} (\S+)$', text, re.M).group(1))
    streams = float(re.search(r'^mstar_codec_streams\{[^}]*node="codec"[^}]*\} (\S+)$', text, re.M).group(1))
    live = sum(float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M))
    return pages, streams, live


def test_a_client_gone_mid_stream_frees_pages_and_codec_state(server, http: httpx.Client) -> None:
    """A long request (4096 frames, ``ignore_eos``: a few tens of seconds here) hangs up once
    its audio is streaming: the codec holds its state and the dual AR its pages; then both
    are given back, well before it could have finished."""
    options = {"seed": 1, "max_tokens": 4096, "ignore_eos": True}
    form = {"text": "Keep talking for a long while.", "output_modalities": "audio", "streaming": "true",
            "model_kwargs": json.dumps(options)}
    hang_up_when(server.url, "/generate", lambda: held(http)[1] > 0 and held(http)[0] > 0, data=form)
    deadline = time.monotonic() + 20
    while any(state := held(http)):
        assert time.monotonic() < deadline, f"pages / codec streams / requests still held: {state}"
        time.sleep(0.05)


def test_a_prompt_past_max_seq_len_is_refused_naming_input(deployment) -> None:
    with pytest.raises(RequestError) as err:  # one token a character: past the 4608-token max_seq_len
        deployment.spec.prepare_speech(SpeechSpec("long", "a" * 4700))
    assert err.value.field == "input" and "max_seq_len" in str(err.value)
    request = deployment.spec.prepare_speech(SpeechSpec("fits", "a" * 4400, model_kwargs={"max_tokens": 4096}))
    assert request.params["max_new_tokens"] == 4608 - len(request.inputs["prompt_ids"])  # the budget fits the room


@pytest.fixture
def encodings(deployment) -> Iterator[list[int]]:
    """Counts the clip encoder's runs (one a clip encoded) while a test runs."""
    calls: list[int] = []
    hook = deployment.spec.encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def test_a_clip_sent_again_is_not_encoded_again(oai: openai.OpenAI, encodings: list[int]) -> None:
    """The first request encodes the clip; the same clip again (the same bytes, or the same
    audio under another transcript: the codes are the audio's) runs no encoder, and the seeded
    audio is the cold request's."""
    clip = {"ref_audio": data_uri(clip_wav(pitch=333.0)), "ref_text": "A clip", "seed": 3, **SHORT}
    cold = speak(oai, "Once more.", **clip)
    assert len(encodings) == 1 and len(cold) > 0
    assert speak(oai, "Once more.", **clip) == cold
    retold = speak(oai, "Once more.", **{**clip, "ref_text": "Another transcript"})
    assert len(encodings) == 1 and retold != cold  # the transcript is in the prompt, not the key


def test_the_memo_evicts_by_bytes(oai: openai.OpenAI, deployment, encodings: list[int]) -> None:
    spec = deployment.spec
    assert spec.clip_memo.max_bytes == spec.knobs.conditioning_cache_mib << 20 == 64 << 20
    first, second = (data_uri(clip_wav(pitch=p)) for p in (410.0, 420.0))  # same length: same bytes of codes
    kept = spec.__dict__["_clip_memo"]
    try:
        spec.__dict__["_clip_memo"] = probe = ClipMemo(64)
        speak(oai, "Hi.", ref_audio=first, ref_text="One.", seed=1, **SHORT)
        one = probe.bytes
        assert one > 0 and len(encodings) == 1
        spec.__dict__["_clip_memo"] = memo = ClipMemo(64, max_bytes=one)  # room for one clip's codes
        audio = speak(oai, "Hi.", ref_audio=first, ref_text="One.", seed=1, **SHORT)
        assert len(audio) > 0
        speak(oai, "Hi.", ref_audio=first, ref_text="One.", seed=1, **SHORT)
        assert len(encodings) == 2 and memo.bytes == one and len(memo) == 1
        speak(oai, "Hi.", ref_audio=second, ref_text="Two.", seed=1, **SHORT)  # evicts the first
        assert len(encodings) == 3 and memo.bytes == one and len(memo) == 1
        assert speak(oai, "Hi.", ref_audio=first, ref_text="One.", seed=1, **SHORT) == audio  # encoded again
        assert len(encodings) == 4
    finally:
        spec.__dict__["_clip_memo"] = kept


def test_presets_are_listed_and_cloned_as_their_clips(oai: openai.OpenAI, http: httpx.Client,
                                                      encodings: list[int]) -> None:
    listed = http.get("/v1/audio/voices", params={"model": MODEL}).json()["voices"]
    assert [(v["voice_id"], v["source"], v["model"]) for v in listed] == [
        ("default", "bundled", MODEL), ("anna", "preset", MODEL), ("mute", "preset", MODEL)]
    preset = oai.audio.speech.create(model=MODEL, voice="anna", input="A preset speaks.", response_format="pcm",
                                     extra_body={"seed": 6, **SHORT}).content
    uploaded = speak(oai, "A preset speaks.", ref_audio=data_uri(clip_wav(pitch=260.0)), ref_text=PRESET_TEXT,
                     seed=6, **SHORT)
    assert len(preset) > 0 and preset == uploaded and preset != speak(oai, "A preset speaks.", seed=6, **SHORT)
    assert len(encodings) == 1  # the preset's file and its upload are one clip: encoded once
    with pytest.raises(openai.BadRequestError, match="transcript") as err:
        oai.audio.speech.create(model=MODEL, voice="mute", input="Hello.", response_format="pcm")
    assert "voice" in str(err.value)

