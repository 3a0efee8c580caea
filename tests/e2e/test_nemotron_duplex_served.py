"""Nemotron VoiceChat's input side served on the CPU: a tiny checkpoint folder (the duplex
config with a tiny FastConformer and Nemotron-H, a byte-level tokenizer), dummy weights, the
in-process runtime. Live calls over ``/generate/ws`` in 80 ms appends get one agent frame per
encoder frame, in order, end on ``end_input`` and free every slot and page; a live call
equals the same audio uploaded at once; 16 concurrent calls equal their solo runs; the limits
(a 48 kHz append, a 3-channel upload, an over-long call, a pool smaller than the cap) get
their errors, naming the field or key."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tokenizers.pre_tokenizers import ByteLevel
from transformers import NemotronHConfig as HFConfig
from transformers import Qwen2Tokenizer

from mstar.audio.io import encode_wav
from mstar.config import ConfigError, parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.asgi_ws import AsgiSocket

MODEL = "nemotron_duplex"
FRAME = 1280  # 80 ms at 16 kHz
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# The talker's tiny config (VoiceChat's model.speech_generation): a 3-layer Gemma-3 backbone
# with a sliding layer, 6 codebooks of 16, a narrow codec; a 0.4 s speaker prompt (5 frames).
TALKER = {"model": {
    "tts_config": {"use_gated_fusion_for_text_audio": True, "disable_eos_prediction": True,
                   "use_audio_prompt_frozen_projection": True, "backbone_type": "gemma3_text",
                   "backbone_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                       "sliding_window": 6,
                                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                   "latent_size": 16, "codebook_size": 16, "num_quantizers": 6,
                   "mog_head_config": {"intermediate_size": 32, "num_layers": 2, "low_rank": 8, "num_predictions": 8}},
    "codec_config": {"latent_size": 16, "base_hidden_size": 8, "num_blocks": 1, "codebook_size": 16,
                     "num_quantizers": 6},
    "inference_guidance_scale": 0.5, "inference_top_p_or_k": 0.8, "inference_noise_scale": 0.8},
    "data": {"target_sample_rate": 22050, "frame_length": 0.08, "audio_prompt_duration": 0.4}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("nemotron_duplex_tiny")
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(directory)
    llm = HFConfig(vocab_size=272, hidden_size=32, hybrid_override_pattern="M*-M-", num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                   n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16, eos_token_id=2, pad_token_id=3)
    encoder = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
               "conv_kernel_size": 9, "subsampling_conv_channels": 8, "left_context": 70}
    (directory / "config.json").write_text(json.dumps({"encoder": encoder, "llm": llm.to_dict(), "n_mels": 16,
                                                       "speech_generation": TALKER}))
    return directory


def _config(checkpoint: Path, **overrides) -> dict:
    slots = {"max_slots": 17}
    return {"model": MODEL, "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 128,
            "max_concurrent_requests": 16,
            "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 16}, "mamba_state": slots,
                          "encoder_state": slots, "codec_state": slots,
                          "talker_kv": {"max_num_pages": 64, "page_size": 16}},
            "model_kwargs": {"seed": 3, "max_session_s": 2.0, "max_prompt_tokens": 32, "temperature": 0.0}} | overrides


@pytest.fixture(scope="module")
def served(checkpoint: Path):
    d = start(parse_config(_config(checkpoint)), in_process=True)
    try:
        yield d, create_app(d.backend, served_model_names=[MODEL])
    finally:
        d.close()


def speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000 / FRAME)) * FRAME
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * (150 + 50 * seed) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    return encode_wav(samples, rate)


def quantised(samples: np.ndarray) -> np.ndarray:
    """What a PCM16 WAV of ``samples`` decodes to (the appends travel as PCM16)."""
    return np.round(np.clip(samples, -1, 1) * 32767).astype(np.int16)


async def live_call(app, samples: np.ndarray, *, text: str = "", pause: float = 0.0,
                    extra: list | None = None, kwargs: dict | None = None) -> list:
    async with AsgiSocket(app) as ws:
        await ws.send_json({"text": text, "output_modalities": "text", "model_kwargs": kwargs or {}})
        for at in range(0, len(samples), FRAME):
            await ws.send_bytes(wav(samples[at:at + FRAME]))
            if pause:
                await asyncio.sleep(pause)
        for message in extra or []:
            await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_json(message))
        await ws.send_json({"type": "end_input"})
        return await ws.receive_all()


def tokens_of(messages: list) -> list[int]:
    return [t for m in messages if isinstance(m, dict) and m["type"] == "output" for t in m["token_ids"]]


async def upload(app, files: list[bytes], text: str = "") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/generate", data={"text": text, "output_modalities": "text"},
                                 files=[("files", (f"a{i}.wav", f, "audio/wav")) for i, f in enumerate(files)],
                                 timeout=120)


def drained(d) -> bool:
    engines = d.runtime.workers.workers[0].engines
    nano, encoder = engines["nano_llm"].inner, engines["conformer_encoder"]
    talker = engines["eartts_talker"].talker
    return (talker.pages_used == 0 and talker.slots_used == 0 and not talker.sessions
            and encoder.pool.num_used == 0 and not encoder.fronts and nano.forward.states.num_used == 0
            and nano.pool.num_used_pages == 0 and not nano.seqs and not engines["nano_llm"].last
            and d.runtime.conductor.idle and not d.runtime.tracked
            and len(d.runtime.workers.workers[0].store._values) == 0)


def wait_drained(d, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not drained(d) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert drained(d), "a slot, page or stream item is still held"


def test_live_call_gets_one_agent_frame_per_frame_and_ends_on_end_input(served):
    d, app = served
    audio = speech(1.6, seed=1)  # 20 appends of 80 ms
    messages = asyncio.run(live_call(app, audio, text="be kind", pause=0.01))
    outputs = [m for m in messages if isinstance(m, dict) and m["type"] == "output"]
    assert all(m["append"] == 0 and m["modality"] == "text" for m in outputs)
    assert len(tokens_of(messages)) == 20 + 1  # (N // 160 + 1) mel frames, 8x subsampled
    assert len(outputs) > 1  # frames streamed as the appends came, not all at the end
    assert messages[-1]["type"] == "done" and messages[-1]["appends"] == 20
    wait_drained(d)


async def one_shot(app, audio: np.ndarray, text: str = "") -> list:
    """The whole clip in the opening message, with ``end_input``: one append."""
    async with AsgiSocket(app) as ws:
        await ws.send_json({"text": text, "output_modalities": "text", "end_input": True,
                            "media": [base64.b64encode(wav(audio)).decode()]})
        return await ws.receive_all()


def test_live_call_equals_the_same_audio_uploaded_at_once(served):
    d, app = served
    audio = quantised(speech(1.2, seed=2)).astype(np.float32) / 32767
    live = tokens_of(asyncio.run(live_call(app, audio, text="hello")))
    assert len(live) == 15 + 1
    assert tokens_of(asyncio.run(one_shot(app, audio, text="hello"))) == live
    response = asyncio.run(upload(app, [wav(audio)], text="hello"))  # /generate: one-shot too
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == len(live) and body["finish_reason"] == "stop"
    wait_drained(d)


def test_concurrent_calls_equal_their_solo_runs(served):
    d, app = served
    clips = [speech(0.4 + 0.08 * (i % 4), seed=10 + i) for i in range(16)]
    solo = [tokens_of(asyncio.run(live_call(app, c))) for c in clips]

    async def together():
        return await asyncio.gather(*[live_call(app, c, pause=0.005) for c in clips])

    engine = d.runtime.workers.workers[0].engines["nano_llm"]
    widths: list[int] = []
    run = engine.run
    engine.run = lambda items: widths.append(sum(i.op == "frame" for i in items)) or run(items)
    try:
        results = asyncio.run(together())
    finally:
        del engine.run
    for alone, messages in zip(solo, results):
        assert tokens_of(messages) == alone
    assert max(widths) > 1  # the calls' frames really shared steps
    wait_drained(d)


def test_a_hang_up_frees_every_slot_and_page(served):
    d, app = served

    async def go():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"output_modalities": "text"})
            for at in range(0, 8 * FRAME, FRAME):
                await ws.send_bytes(wav(speech(0.64, seed=5)[at:at + FRAME]))
            await asyncio.sleep(0.5)
            assert d.runtime.workers.workers[0].engines["conformer_encoder"].pool.num_used == 1
            await ws.hang_up()

    asyncio.run(go())
    wait_drained(d)


def test_a_wrong_append_is_refused_naming_the_field_and_the_call_goes_on(served):
    d, app = served
    audio = speech(0.64, seed=6)
    stereo = np.stack([audio[:FRAME]] * 2, axis=1)
    messages = asyncio.run(live_call(app, audio, extra=[wav(audio[:3 * FRAME], rate=48000), wav(stereo)]))
    errors = [m for m in messages if isinstance(m, dict) and m["type"] == "error"]
    assert [(e["field"], e["status"]) for e in errors] == [("media[0]", 400), ("media[0]", 400)]
    assert "16000 Hz" in errors[0]["message"] and "channels" in errors[1]["message"]
    assert len(tokens_of(messages)) == 8 + 1 and messages[-1]["type"] == "done"
    wait_drained(d)


def test_uploads_check_channels_rate_and_length(served):
    d, app = served
    three = np.stack([speech(0.32, seed=7)] * 3, axis=1)
    response = asyncio.run(upload(app, [wav(three)]))
    assert response.status_code == 400 and "files[0]" in response.text and "3 channels" in response.text
    response = asyncio.run(upload(app, [wav(speech(0.32, seed=7), rate=48000)]))
    assert response.status_code == 400 and "16000 Hz" in response.text
    response = asyncio.run(upload(app, [wav(speech(2.4, seed=7))]))  # max_session_s is 2
    assert response.status_code == 400
    response = asyncio.run(upload(app, []))  # a one-shot call with no audio
    assert response.status_code == 400 and "files" in response.text
    two = np.stack([speech(0.32, seed=7), np.zeros(int(0.32 * 16000), np.float32)], axis=1)
    left = asyncio.run(upload(app, [wav(two)]))  # a conversation: the user is the left channel
    mono = asyncio.run(upload(app, [wav(two[:, 0].copy())]))
    assert left.status_code == 200 and left.json()["text"] == mono.json()["text"]
    assert left.json()["usage"]["completion_tokens"] == 4 + 1
    wait_drained(d)


def test_a_call_past_max_session_s_gets_a_400_and_ends(served):
    d, app = served
    messages = asyncio.run(live_call(app, speech(2.4, seed=8)))  # 2 s allowed
    errors = [m for m in messages if isinstance(m, dict) and m["type"] == "error"]
    assert errors and errors[0]["field"] == "audio_in" and errors[0]["status"] == 400
    assert "passes its limit of 32000" in errors[0]["message"]
    assert len(tokens_of(messages)) == 25 + 1  # what it heard up to the cap
    wait_drained(d)


def test_a_call_too_short_to_featurize_fails_alone(served):
    d, app = served

    async def go():
        async def short():
            async with AsgiSocket(app) as ws:
                await ws.send_json({"output_modalities": "text"})
                await ws.send_bytes(wav(np.zeros(200, np.float32)))
                await ws.send_json({"type": "end_input"})
                return await ws.receive_all()

        return await asyncio.gather(short(), live_call(app, speech(0.48, seed=12)))

    bad, good = asyncio.run(go())
    assert any(isinstance(m, dict) and m["type"] == "error" and "too short" in m["message"] for m in bad)
    assert tokens_of(good) == tokens_of(asyncio.run(live_call(app, speech(0.48, seed=12))))
    wait_drained(d)


def test_startup_refuses_a_pool_smaller_than_the_cap(checkpoint: Path):
    config = _config(checkpoint, max_concurrent_requests=17)
    config["resources"] = config["resources"] | {"mamba_state": {"max_slots": 18}, "codec_state": {"max_slots": 18},
                                                 "kv_cache": {"max_num_pages": 136, "page_size": 16}}
    with pytest.raises(ConfigError, match=r"resources\.encoder_state\.max_slots"):
        start(parse_config(config), in_process=True)
    # every call's KV pages: 32 prompt tokens and 27 frames of 2 s are 4 pages of 16
    small = _config(checkpoint, resources={"kv_cache": {"max_num_pages": 63, "page_size": 16}})
    with pytest.raises(ConfigError, match=r"resources\.kv_cache\.max_num_pages.*at least 64"):
        start(parse_config(small), in_process=True)


def test_a_prompt_past_max_prompt_tokens_is_a_400_naming_text(served):
    d, app = served
    response = asyncio.run(upload(app, [wav(speech(0.32, seed=7))], text="x" * 33))
    assert response.status_code == 400 and '"text"' in response.text and "max_prompt_tokens" in response.text


def test_media_in_the_opening_is_the_first_append(served):
    d, app = served
    audio = speech(0.96, seed=9)

    async def go():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"output_modalities": "text", "media": [base64.b64encode(wav(audio[:480])).decode()]})
            for at in range(480, len(audio), FRAME):
                await ws.send_bytes(wav(audio[at:at + FRAME]))
            await ws.send_json({"type": "end_input"})
            return await ws.receive_all()

    assert tokens_of(asyncio.run(go())) == tokens_of(asyncio.run(live_call(app, audio)))
    wait_drained(d)


def test_sampling_is_seeded_per_call_and_checked(served):
    d, app = served
    audio = speech(0.64, seed=13)
    sampled = {"temperature": 1.5, "seed": 5}
    first = tokens_of(asyncio.run(live_call(app, audio, kwargs=sampled)))
    assert tokens_of(asyncio.run(live_call(app, audio, kwargs=sampled, pause=0.01))) == first
    assert first != tokens_of(asyncio.run(live_call(app, audio, kwargs={"temperature": 1.5, "seed": 6})))
    messages = asyncio.run(live_call(app, audio, kwargs={"temperature": -1}))
    assert messages[0]["type"] == "session" and messages[1]["field"] == "temperature"
    wait_drained(d)


def test_encoder_and_llm_on_two_ranks_equal_one(served, checkpoint: Path):
    """The encoder on rank 0 and the LLM on rank 1 (frames cross on the tensor transport):
    the same agent frames as the single-rank deployment, and nothing left on either rank."""
    _, app = served
    audio = speech(0.8, seed=1)
    groups = [{"node_names": ["conformer_encoder"], "ranks": [0]},
              {"node_names": ["nano_llm", "eartts_talker"], "ranks": [1]}]
    split = start(parse_config(_config(checkpoint, node_groups=groups)), in_process=True)
    try:
        got = tokens_of(asyncio.run(live_call(create_app(split.backend, served_model_names=[MODEL]), audio)))
        deadline = time.monotonic() + 10
        while any(len(w.store._values) for w in split.runtime.workers.workers.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(len(w.store._values) for w in split.runtime.workers.workers.values())
    finally:
        split.close()
    assert got == tokens_of(asyncio.run(live_call(app, audio))) and len(got) == 10 + 1
