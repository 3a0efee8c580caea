"""Qwen3-Omni over HTTP with the official ``openai`` client: the tiny random whole model of
``tests/support/qwen3_omni_dir.py`` served in process (fp32, CPU) under uvicorn in a thread,
every request greedy. A chat with an ``input_audio`` part answers the plain thinker's text, one
with a ``video_url`` part the in-process backend's; a spoken answer (``modalities: ["text",
"audio"]``) comes whole as a 24 kHz WAV with that text as its transcript, and streamed as PCM16
pieces holding the same samples; a text request never runs the talker or code2wav;
/v1/audio/voices lists the checkpoint's speakers and bad voices or formats are 400s naming the
field; concurrent spoken requests equal their solo answers, and a client that leaves a spoken
stream leaves nothing running and every KV page free."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from PIL import Image

pytest.importorskip("transformers.models.qwen3_omni_moe")

from inprocess import deployed, poll_drained, record_batches  # noqa: E402
from live_server import Uvicorn  # noqa: E402

from mstar.contract import ChatSpec, SamplingParams  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniCheckpoint  # noqa: E402
from mstar.model.qwen3_omni.inputs import splice_features  # noqa: E402
from mstar.model.qwen3_omni.speech import run_thinker  # noqa: E402
from mstar.model.speech_output import pcm_to_array  # noqa: E402
from mstar.runtime.launch import Deployment  # noqa: E402
from mstar.server.app import create_app  # noqa: E402
from tests.support.qwen3_omni import ACCEPT_HIDDEN_LAYER, AUDIO_TOKEN, CHAT  # noqa: E402
from tests.support.qwen3_omni_dir import (  # noqa: E402
    MAX_FRAMES,
    deployment_config,
    mp4,
    tokenizer,
    wav,
    write_checkpoint,
)

MODEL = "qwen3_omni"
MAX_TOKENS = 6
VOICE = "tiny"  # the tiny talker's one speaker
RATE = 24000
PCM16_STEP = 1 / 32767
SPOKEN = {"voice": VOICE, "format": "wav"}
CLIP = wav(1.3, 1)
VIDEO = mp4(10, (24, 16), 5.0, seed=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_omni_http"))


@pytest.fixture(scope="module")
def deployment(checkpoint: Path) -> Iterator[Deployment]:
    with deployed(deployment_config(checkpoint)) as d:
        yield d


@pytest.fixture(scope="module")
def server(deployment: Deployment) -> Iterator[Uvicorn]:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def _engines(d: Deployment) -> dict:
    return d.runtime.workers.workers[0].engines


def audio_part(data: bytes = CLIP, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def png_part(size: tuple[int, int] = (16, 16)) -> dict:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": uri}}


def video_part(data: bytes = VIDEO) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def user(*parts: dict | str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


def ask(oai: openai.OpenAI, messages: list[dict], spoken: dict | None = None, **kw):
    extra = {"modalities": ["text", "audio"], "audio": spoken} if spoken else {}
    return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       **extra, **kw)


def wav_samples(answer) -> np.ndarray:
    """The PCM16 samples of a whole spoken answer's WAV (24 kHz mono, checked)."""
    data, rate = sf.read(io.BytesIO(base64.b64decode(answer.choices[0].message.audio.data)), dtype="int16")
    assert rate == RATE and data.ndim == 1
    return data


def streamed(oai: openai.OpenAI, messages: list[dict]) -> tuple[str, np.ndarray, list]:
    """A streamed spoken answer: its transcript, the PCM16 samples of its pieces, its chunks."""
    chunks = list(ask(oai, messages, SPOKEN, stream=True))
    pieces = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio is not None]
    pieces = [p if isinstance(p, dict) else p.model_dump(exclude_none=True) for p in pieces]
    pcm = b"".join(base64.b64decode(p["data"]) for p in pieces if "data" in p)
    return "".join(p.get("transcript", "") for p in pieces), np.frombuffer(pcm, "<i2"), chunks


def test_an_input_audio_chat_answers_the_plain_thinkers_text(oai: openai.OpenAI, deployment: Deployment,
                                                             checkpoint: Path) -> None:
    """The served text equals the plain thinker's greedy answer (``run_thinker`` on the prompt's
    embeddings with the audio tower's rows spliced over the audio tokens), decoded."""
    content = [{"type": "text", "text": "listen:"}, {"type": "audio", "data": CLIP}]
    probe = ChatSpec(request_id=f"probe-{uuid.uuid4().hex[:8]}", messages=[{"role": "user", "content": content}],
                     sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS)
    inputs = deployment.spec.prepare_chat(probe).inputs
    ids = inputs["prompt_ids"]
    thinker = Qwen3OmniCheckpoint(checkpoint).thinker(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    with torch.no_grad():
        embeds = splice_features(thinker.text.model.embed_tokens(ids), ids, AUDIO_TOKEN,
                                 thinker.audio_tower([inputs["audio_mels"]]))
    want = run_thinker(thinker.text, ids.tolist(), MAX_TOKENS, [CHAT["im_end_token_id"]], ACCEPT_HIDDEN_LAYER,
                       prompt_embeds=embeds).generated

    answer = ask(oai, user("listen:", audio_part()))
    assert answer.choices[0].message.content == tokenizer().decode(want, skip_special_tokens=True)
    assert answer.usage.completion_tokens == len(want)
    assert answer.usage.prompt_tokens == len(ids) > 20  # the clip's audio tokens are in the prompt


def _in_process_speech(d: Deployment, content: list[dict]) -> np.ndarray:
    """The float samples the backend's speech walk gives for ``content``, with no HTTP between."""
    spec = ChatSpec(request_id=f"direct-{uuid.uuid4().hex[:8]}", messages=[{"role": "user", "content": content}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS,
                    output_modalities=["text", "audio"], audio={"voice": VOICE, "format": "wav"})

    async def events() -> list:
        return [e async for e in d.backend.chat(spec)]

    return pcm_to_array([e for e in asyncio.run(events()) if e.modality == "audio"])


def test_a_spoken_answer_whole_and_streamed(oai: openai.OpenAI, deployment: Deployment) -> None:
    messages = user(audio_part(), "answer")
    text = ask(oai, messages).choices[0].message.content
    assert text

    whole = ask(oai, messages, SPOKEN)
    message = whole.choices[0].message
    assert message.content is None and message.audio.transcript == text
    samples = wav_samples(whole)
    direct = _in_process_speech(deployment, [{"type": "audio", "data": CLIP}, {"type": "text", "text": "answer"}])
    assert samples.size == direct.size > 0 and np.abs(direct).max() > 10 * PCM16_STEP
    assert np.abs(samples / 32767 - direct).max() <= PCM16_STEP  # the speech walk's samples, as PCM16

    transcript, pcm, chunks = streamed(oai, messages)
    assert transcript == text
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert pcm.shape == samples.shape
    assert int(np.abs(pcm.astype(np.int32) - samples).max()) <= 1  # within one PCM16 step


def test_a_text_request_never_touches_the_talker(oai: openai.OpenAI, deployment: Deployment) -> None:
    engines = _engines(deployment)
    with record_batches(engines["talker"]) as talker, record_batches(engines["code2wav"]) as codec:
        assert ask(oai, user("hello", audio_part())).choices[0].message.content
        assert ask(oai, [{"role": "user", "content": "hello"}]).choices[0].message.content
        assert talker.batches == [] and codec.batches == []
        assert ask(oai, [{"role": "user", "content": "hello"}], SPOKEN).choices[0].message.audio.data
        assert talker.batches and codec.batches  # the same counters see a spoken answer


def test_a_video_url_chat_answers_as_the_backend(oai: openai.OpenAI, deployment: Deployment) -> None:
    """A ``video_url`` part (an mp4 data URI) reaches the model as the video's bytes: the served
    text equals the in-process backend's answer to the same bytes."""
    content = [{"type": "text", "text": "watch"}, {"type": "video", "data": VIDEO}]
    spec = ChatSpec(request_id=f"probe-{uuid.uuid4().hex[:8]}", messages=[{"role": "user", "content": content}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS)

    async def direct() -> str:
        return "".join([e.text async for e in deployment.backend.chat(spec)])

    want = asyncio.run(direct())
    assert want and ask(oai, user("watch", video_part())).choices[0].message.content == want


def test_voices_are_listed_and_bad_choices_refused(oai: openai.OpenAI, server: Uvicorn) -> None:
    voices = httpx.get(f"{server.url}/v1/audio/voices", timeout=10).json()["voices"]
    assert [(v["voice_id"], v["model"]) for v in voices] == [(VOICE, MODEL)]

    cases = [
        (user("hi"), {"voice": "nobody", "format": "wav"}, "audio.voice"),
        (user("hi"), {"voice": VOICE, "format": "opus"}, "audio.format"),
        (user("hi", audio_part(fmt="aiff")), None, "messages[0].content[1].input_audio.format"),
        (user("see", png_part()), SPOKEN, "modalities"),  # no talker positions for images yet
        (user("watch", video_part()), SPOKEN, "modalities"),  # nor for videos
    ]
    for messages, spoken, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            ask(oai, messages, spoken)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body  # type: ignore[index]
    assert ask(oai, user("still here")).choices[0].message.content is not None


def test_concurrent_spoken_requests_equal_solo(oai: openai.OpenAI, deployment: Deployment) -> None:
    cases = [user("speak up"), user(audio_part(wav(0.9, 2)), "?")]

    def spoken(messages: list[dict]) -> tuple[str, bytes]:
        message = ask(oai, messages, SPOKEN).choices[0].message
        return message.audio.transcript, base64.b64decode(message.audio.data)

    alone = [spoken(m) for m in cases]
    assert alone[0] != alone[1]
    # Whether the two reach the conductor together depends on the machine's load: up to three
    # tries for them to share a talker step.
    for _ in range(3):
        with record_batches(_engines(deployment)["talker"]) as rec, ThreadPoolExecutor(2) as pool:
            assert list(pool.map(spoken, cases)) == alone
        if max(len(batch) for batch in rec.batches) > 1:
            break
    assert max(len(batch) for batch in rec.batches) > 1, "the two requests never shared a talker step"


def test_leaving_a_spoken_stream_frees_everything(oai: openai.OpenAI, server: Uvicorn,
                                                  deployment: Deployment) -> None:
    """The talker is slowed (a sleep a step) so that the client surely leaves mid-speech: after
    the first audio piece, with frames still to come."""
    engines = _engines(deployment)
    talker, thinker = engines["talker"], engines["thinker"]
    original = talker.run
    steps: list[float] = []
    talker.run = lambda items: (time.sleep(0.05), steps.append(time.monotonic()), original(items))[2]
    body = {"model": MODEL, "messages": user("talk to me"), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "modalities": ["text", "audio"], "audio": SPOKEN}
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                delta = json.loads(line[6:])["choices"][0]["delta"] if line.startswith("data: {") else {}
                if "data" in (delta.get("audio") or {}):
                    break
            assert talker.engine.pool.num_used_pages > 0 and deployment.runtime.tracked  # it is speaking
            left = time.monotonic()
        poll_drained(deployment, thinker, also=lambda: talker.engine.pool.num_used_pages == 0)
    finally:
        del talker.run
    assert thinker.pool.num_used_pages == 0 and talker.engine.pool.num_used_pages == 0
    assert not deployment.runtime.tracked and deployment.runtime.conductor.idle
    assert len(steps) < MAX_FRAMES and sum(t > left for t in steps) <= 4  # stopped, not spoken to the end
    assert ask(oai, user("again")).choices[0].message.content is not None
