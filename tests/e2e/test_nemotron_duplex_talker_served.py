"""Nemotron VoiceChat with its talker served on the CPU (the tiny checkpoint folder of
``test_nemotron_duplex_served.py`` with its tiny EarTTS config, dummy weights, the in-process
runtime): a call that asks for audio gets, per agent frame, its text token and its 80 ms of
22.05 kHz PCM; the call's PCM is the whole codec decode of its frames' codes; concurrent
seeded calls equal their solo runs; every talker page and codec slot is freed after
``end_input`` and after a hang-up; a one-shot upload returns text and audio; startup refuses a
talker pool smaller than the cap, naming its key."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from mstar.config import ConfigError, parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.e2e.test_nemotron_duplex_served import (  # noqa: F401  (checkpoint: a fixture)
    FRAME,
    MODEL,
    _config,
    checkpoint,
    live_call,
    speech,
    wait_drained,
    wav,
)
from tests.support.asgi_ws import AsgiSocket

SAMPLES = 1764  # one 80 ms frame at 22.05 kHz
SPEECH = "text,audio"


@pytest.fixture(scope="module")
def served(checkpoint: Path):  # noqa: F811
    d = start(parse_config(_config(checkpoint)), in_process=True)
    try:
        yield d, create_app(d.backend, served_model_names=[MODEL])
    finally:
        d.close()


def talker_of(d):
    return d.runtime.workers.workers[0].engines["eartts_talker"]


async def speaking_call(app, samples: np.ndarray, *, seed: int, pause: float = 0.0,
                        outputs: str | None = SPEECH) -> list:
    """A live call; ``outputs=None`` leaves ``output_modalities`` out (the model's default)."""
    opening = {"text": "hi", "model_kwargs": {"seed": seed}}
    if outputs is not None:
        opening["output_modalities"] = outputs
    async with AsgiSocket(app) as ws:
        await ws.send_json(opening)
        for at in range(0, len(samples), FRAME):
            await ws.send_bytes(wav(samples[at:at + FRAME]))
            if pause:
                await asyncio.sleep(pause)
        await ws.send_json({"type": "end_input"})
        return await ws.receive_all()


def tokens_of(messages: list) -> list[int]:
    return [t for m in messages if isinstance(m, dict) and m["type"] == "output" and m["modality"] == "text"
            for t in m["token_ids"]]


def audio_of(messages: list) -> list[np.ndarray]:
    """Each audio output's samples (a header naming its bytes, then the binary message)."""
    out = []
    for header, body in zip(messages, messages[1:]):
        if isinstance(header, dict) and header.get("type") == "output" and header["modality"] == "audio":
            assert isinstance(body, bytes) and len(body) == header["bytes"]
            out.append(np.frombuffer(body, dtype="<f4"))
    return out


class Recorder:
    """Every frame's codes per call, from the talker engine's steps; the widest step."""

    def __init__(self, d) -> None:
        self.engine = talker_of(d).talker
        self.codes: dict[str, list[torch.Tensor]] = {}
        self.widths: list[int] = []

    def __enter__(self):
        step = self.engine.step

        def recording(tokens, noise=None):
            frames = step(tokens, noise)
            self.widths.append(len(tokens))
            for sid, frame in frames.items():
                self.codes.setdefault(sid, []).append(frame.codes.clone())
            return frames

        self.engine.step = recording
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step


def test_a_speaking_call_gets_each_frames_text_and_pcm_and_frees_everything(served):
    d, app = served
    audio = speech(1.2, seed=1)  # 15 appends of 80 ms: 16 agent frames
    with Recorder(d) as rec:
        messages = asyncio.run(speaking_call(app, audio, seed=7, pause=0.01))
    tokens = tokens_of(messages)
    assert len(tokens) == 15 + 1 and messages[-1]["type"] == "done"
    assert tokens == tokens_of(asyncio.run(live_call(app, audio, text="hi", kwargs={"seed": 7})))  # text unchanged
    chunks = audio_of(messages)
    # one frame's PCM a step, as the frames come: the first frame's six samples of padding
    # trimmed, the codec's last six flushed with the last frame when the call ends
    assert [len(c) for c in chunks] == [SAMPLES - 6] + [SAMPLES] * (len(tokens) - 2) + [SAMPLES + 6]
    pcm = np.concatenate(chunks)
    assert pcm.shape[0] == SAMPLES * len(tokens) and np.abs(pcm).max() > 0
    # the call's PCM is the whole decode of its frames' codes (the talker's, through the codec at once)
    (codes,) = rec.codes.values()
    assert len(codes) == len(tokens)
    model = talker_of(d).talker.model
    with torch.no_grad():
        whole = model.codec.decode(torch.stack(codes)[None])[0].numpy()
    peak = float(np.abs(whole).max())
    print(f"live PCM vs whole decode: {np.abs(pcm - whole).max() / peak:.2e} of peak {peak:.3g}")
    np.testing.assert_allclose(pcm, whole, rtol=0, atol=2e-5 * peak)
    wait_drained(d)


def test_concurrent_speaking_calls_equal_their_solo_runs(served):
    d, app = served
    clips = [speech(0.4 + 0.08 * (i % 4), seed=20 + i) for i in range(16)]
    solo = [asyncio.run(speaking_call(app, c, seed=30 + i)) for i, c in enumerate(clips)]

    async def together():
        return await asyncio.gather(*[speaking_call(app, c, seed=30 + i, pause=0.005) for i, c in enumerate(clips)])

    with Recorder(d) as rec:
        results = asyncio.run(together())
    assert max(rec.widths) > 1  # the calls' frames really shared talker steps
    worst = 0.0
    for alone, messages in zip(solo, results):
        assert tokens_of(messages) == tokens_of(alone)
        mine, theirs = np.concatenate(audio_of(messages)), np.concatenate(audio_of(alone))
        assert mine.shape == theirs.shape == (SAMPLES * len(tokens_of(alone)),)
        # batched convolutions sum in another order: within 1e-4 of the peak
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4 * float(np.abs(theirs).max()))
        worst = max(worst, float(np.abs(mine - theirs).max() / np.abs(theirs).max()))
    print(f"16 concurrent calls vs solo: PCM within {worst:.2e} of peak")
    wait_drained(d)


def test_a_hang_up_frees_the_talkers_pages_and_slot(served):
    d, app = served

    async def go():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"output_modalities": SPEECH, "model_kwargs": {"seed": 1}})
            for at in range(0, 8 * FRAME, FRAME):
                await ws.send_bytes(wav(speech(0.64, seed=5)[at:at + FRAME]))
            talker = talker_of(d).talker
            for _ in range(200):  # until the talker spoke a frame (a slot at open, pages at its first step)
                if talker.slots_used and talker.pages_used:
                    break
                await asyncio.sleep(0.02)
            assert talker.slots_used == 1 and talker.pages_used > 0
            await ws.hang_up()

    asyncio.run(go())
    wait_drained(d)


def test_a_one_shot_upload_returns_text_and_audio(served):
    d, app = served
    audio = speech(0.8, seed=3)

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/generate", data={"text": "hi", "output_modalities": SPEECH,
                                                        "model_kwargs": json.dumps({"seed": 4})},
                                     files=[("files", ("a.wav", wav(audio), "audio/wav"))], timeout=120)

    response = asyncio.run(post())
    assert response.status_code == 200, response.text
    body = response.json()
    frames = body["usage"]["completion_tokens"]
    assert frames == 10 + 1 and body["sample_rate"] == 22050
    pcm = np.frombuffer(base64.b64decode(body["data"]["audio"]), dtype="<f4")
    assert pcm.shape == (SAMPLES * frames,)
    live = np.concatenate(audio_of(asyncio.run(speaking_call(app, audio, seed=4))))
    np.testing.assert_allclose(pcm, live, rtol=0, atol=1e-4 * float(np.abs(live).max()))  # the same call, live
    wait_drained(d)


def test_leaving_output_modalities_out_speaks_and_text_asks_for_text_only(served):
    """Speech by default, as the reference (which always runs its talker); ``["text"]`` still
    gets the text-only walk."""
    d, app = served
    audio = speech(0.4, seed=5)
    default = asyncio.run(speaking_call(app, audio, seed=9, outputs=None))
    spoken = asyncio.run(speaking_call(app, audio, seed=9))
    assert tokens_of(default) == tokens_of(spoken) and len(tokens_of(default)) == 5 + 1
    np.testing.assert_array_equal(np.concatenate(audio_of(default)), np.concatenate(audio_of(spoken)))
    text_only = asyncio.run(speaking_call(app, audio, seed=9, outputs='["text"]'))
    assert tokens_of(text_only) == tokens_of(default) and audio_of(text_only) == []

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/generate", data={"text": "hi", "model_kwargs": json.dumps({"seed": 9})},
                                     files=[("files", ("a.wav", wav(audio), "audio/wav"))], timeout=120)

    response = asyncio.run(post())
    assert response.status_code == 200, response.text
    assert np.frombuffer(base64.b64decode(response.json()["data"]["audio"]), dtype="<f4").shape == (SAMPLES * 6,)
    wait_drained(d)


def test_startup_refuses_a_talker_pool_smaller_than_the_cap(checkpoint: Path):  # noqa: F811
    config = _config(checkpoint)
    config["resources"] = config["resources"] | {"codec_state": {"max_slots": 16}}
    with pytest.raises(ConfigError, match=r"resources\.codec_state\.max_slots"):
        start(parse_config(config), in_process=True)
    # each call: two streams of 5 warm-up positions and 27 frames of 2 s, in pages of 16: 4 pages
    config["resources"] = config["resources"] | {"codec_state": {"max_slots": 17},
                                                 "talker_kv": {"max_num_pages": 63, "page_size": 16}}
    with pytest.raises(ConfigError, match=r"resources\.talker_kv\.max_num_pages.*at least 64"):
        start(parse_config(config), in_process=True)


def test_the_talker_on_its_own_rank_equals_one_rank(served, checkpoint: Path):  # noqa: F811
    """The encoder and the LLM on rank 0, the talker on rank 1 (agent text crosses on the
    tensor transport): the same text and speech as one rank, and nothing left on either."""
    _, app = served
    audio = speech(0.8, seed=2)
    groups = [{"node_names": ["conformer_encoder", "nano_llm"], "ranks": [0]},
              {"node_names": ["eartts_talker"], "ranks": [1]}]
    split = start(parse_config(_config(checkpoint, node_groups=groups)), in_process=True)
    try:
        got = asyncio.run(speaking_call(create_app(split.backend, served_model_names=[MODEL]), audio, seed=9))
        workers = split.runtime.workers.workers
        deadline = time.monotonic() + 10
        while any(len(w.store._values) for w in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(len(w.store._values) for w in workers.values())
        talker = workers[1].engines["eartts_talker"].talker
        assert talker.pages_used == 0 and talker.slots_used == 0
    finally:
        split.close()
    want = asyncio.run(speaking_call(app, audio, seed=9))
    assert tokens_of(got) == tokens_of(want) and len(tokens_of(got)) == 10 + 1
    mine, theirs = np.concatenate(audio_of(got)), np.concatenate(audio_of(want))
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6 * float(np.abs(theirs).max()))


def test_startup_refuses_an_unknown_speaker_and_a_folder_without_the_talker(checkpoint: Path, tmp_path):  # noqa: F811
    config = _config(checkpoint)
    config["model_kwargs"] = config["model_kwargs"] | {"speaker": "nobody"}
    with pytest.raises(ConfigError, match=r"model_kwargs\.speaker.*'nobody'"):
        start(parse_config(config), in_process=True)
    for name in checkpoint.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["speech_generation"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="speech_generation"):
        start(parse_config(_config(tmp_path)), in_process=True)
