"""The served CosyVoice3 family on tiny dummy weights, in process, on the CPU: what a seeded
request speaks equals ``synthesis.py``'s plain walk (the LM's paged eager decode, then the
flow on the StreamPlanner schedule and the causal HiFT) over the same parts and voice prompt;
concurrent requests speak their solo audio; bad inputs are refused naming the field."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import RequestError, SpeechSpec, VoiceClip
from mstar.model.cosyvoice3 import StreamPlanner
from mstar.model.cosyvoice3.model import CosyVoice3
from mstar.model.cosyvoice3.serving import build_parts
from mstar.model.cosyvoice3.synthesis import VoicePrompt, speech_tokens, stream_audio
from mstar.model.speech_output import pcm_to_array
from mstar.runtime.launch import start

TEXT = "Hi."


def deployment_config() -> dict:
    return {"model": "cosyvoice3", "load_format": "dummy", "device": "cpu", "max_concurrent_requests": 8,
            "max_seq_len": 1024, "node_groups": [{"node_names": ["llm", "vocoder"], "ranks": [0]}],
            "model_kwargs": {"dummy_scale": "tiny"}}


def clip(seconds: float = 1.5, rate: int = 22050, seed: int = 0) -> VoiceClip:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t) + 0.02 * g.standard_normal(t.size)
    return VoiceClip(wave.astype("<f4").tobytes(), rate, "A short clip.")


@pytest.fixture(scope="module")
def deployment():
    d = start(parse_config(deployment_config()), in_process=True)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def front() -> CosyVoice3:
    spec = CosyVoice3(parse_config(deployment_config()))
    spec.load_frontend()
    return spec


def speak(deployment, spec: SpeechSpec) -> np.ndarray:
    async def run():
        return [e async for e in deployment.backend.speech(spec)]

    return pcm_to_array(asyncio.run(run()))


def plain_walk(front: CosyVoice3, text: str, voice: VoicePrompt, seed: int) -> np.ndarray:
    parts = build_parts(None, dummy=True, scale="tiny", seed=0)
    from mstar.model.cosyvoice3 import serving

    ids = serving.text_ids(front.tokenizer, text)
    prompt = VoicePrompt(torch.tensor(front.prompt_text_ids(voice, None)), voice.speech, voice.mel, voice.xvector)
    hop = parts.flow.config.dit.static_chunk_size // parts.flow.config.token_mel_ratio
    tokens = speech_tokens(parts.lm, torch.tensor(ids), prompt, torch.Generator().manual_seed(seed))
    planner = StreamPlanner(prompt_tokens=len(voice.speech), hop=hop, max_hop=4 * hop)
    return torch.cat(list(stream_audio(parts.flow, parts.hift, tokens, prompt, planner))).numpy()


def test_served_audio_is_the_plain_walk(deployment, front) -> None:
    ref = clip()
    got = speak(deployment, SpeechSpec("a", TEXT, reference=ref, model_kwargs={"seed": 3}, sentence_chunking=False))
    want = plain_walk(front, TEXT, front.clip_conditioning(ref), seed=3)
    assert got.size > 0 and got.size == want.size and float(np.abs(want).max()) > 1e-3  # not silence
    err = float(np.abs(got - want).max())
    print(f"[served vs plain walk] {want.size} samples, max abs err {err:.2e}")
    assert err <= 1e-4  # the PCM stream is float32; the walk is float32 too


def test_concurrent_requests_speak_their_solo_audio(deployment) -> None:
    specs = [SpeechSpec(f"r{i}", f"Hi {i}.", reference=clip(seed=i % 3), model_kwargs={"seed": i},
                        sentence_chunking=False) for i in range(8)]
    solo = [speak(deployment, s) for s in specs]
    engines = deployment.runtime.workers.workers[0].engines
    llm, batches = engines["llm"], []
    original = llm.run
    llm.run = lambda items: (batches.append({i.request_id for i in items}), original(items))[1]
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda s: speak(deployment, s), specs))
    finally:
        del llm.run
    assert max(len(b) for b in batches) >= 4  # the LM steps of concurrent requests share batches
    assert not engines["vocoder"].streams  # every request's vocoder state is freed at its end
    assert solo[0].size != solo[1].size or not np.array_equal(solo[0], solo[1])  # seeds and voices matter
    for a, b in zip(solo, together, strict=True):
        assert a.size > 0 and a.size == b.size and float(np.abs(a - b).max()) <= 1e-4


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"speed": 1.5}, "speed"),
    ({"model_kwargs": {"nope": 1}}, "model_kwargs"),
    ({"voice": "nobody"}, "voice"),
    ({"input": "   "}, "input"),
])
def test_bad_inputs_name_the_field(front, kwargs, field) -> None:
    base = {"request_id": "x", "input": TEXT, "reference": clip()}
    if "voice" in kwargs:
        base.pop("reference")
    with pytest.raises(RequestError) as err:
        front.prepare_speech(SpeechSpec(**{**base, **kwargs}))
    assert err.value.field == field


def test_a_request_without_a_voice_is_told_to_send_ref_audio(front) -> None:
    with pytest.raises(RequestError) as err:
        front.prepare_speech(SpeechSpec("x", TEXT))
    assert err.value.field == "ref_audio"


def test_an_unknown_or_bad_deployment_knob_stops_startup_naming_it() -> None:
    from mstar.config import ConfigError

    for kwargs, name in (({"colour": 1}, "colour"), ({"flow_estimator_dtype": "float16"}, "flow_estimator_dtype"),
                         ({"sentence_chunking": "maybe"}, "sentence_chunking"),
                         ({"dummy_scale": "huge"}, "dummy_scale")):
        config = deployment_config()
        config["model_kwargs"] = {**config["model_kwargs"], **kwargs}
        with pytest.raises(ConfigError, match=name):
            CosyVoice3(parse_config(config))
    config = deployment_config()
    config["model_kwargs"] = {**config["model_kwargs"], "voices_dir": "/nonexistent/voices"}
    with pytest.raises(ValueError, match="voices_dir"):
        CosyVoice3(parse_config(config)).load_frontend()


def test_long_text_is_spoken_as_sentence_pieces(front) -> None:
    text = " ".join(f"This is sentence number {i} of a long text." for i in range(20))
    ref = clip()
    pieces = front.prepare_speech(SpeechSpec("p", text, reference=ref))
    whole = front.prepare_speech(SpeechSpec("w", text, reference=ref, sentence_chunking=False))
    assert isinstance(pieces, list) and len(pieces) > 2 and not isinstance(whole, list)
    assert all(p.inputs["prompt_speech"] is whole.inputs["prompt_speech"] for p in pieces)  # one encoding


@pytest.mark.slow
def test_the_released_shapes_build() -> None:
    """``load_format: dummy`` at the released shapes: the parts and front ends build (slow: 0.5B LM, 300M DiT)."""
    parts = build_parts(None, dummy=True, scale="real")
    assert sum(p.numel() for p in parts.lm.parameters()) > 4e8
    assert parts.flow.config.dit.depth == 22 and parts.hift.config.causal


def test_an_instruction_replaces_the_transcript_and_the_lm_prompt_speech(front) -> None:
    ref = clip()
    voice = front.clip_conditioning(ref)
    plain = front.prepare_speech(SpeechSpec("z", TEXT, reference=ref, sentence_chunking=False))
    styled = front.prepare_speech(SpeechSpec("s", TEXT, reference=ref, sentence_chunking=False,
                                             model_kwargs={"instructions": "Speak slowly."}))
    speech_vocab = front.lm_config.speech_vocab
    n_speech = len(voice.speech)
    assert plain.inputs["prompt_ids"][-n_speech:].tolist() == voice.speech.tolist()  # zero-shot: LM hears the clip
    assert int((styled.inputs["prompt_ids"] < speech_vocab).sum()) == 2  # instruct2: only sos and task
    text = bytes((styled.inputs["prompt_ids"][1:-1] - speech_vocab).tolist()[:-len(TEXT) - 1]).decode()
    assert text == "You are a helpful assistant. Speak slowly."
    assert styled.inputs["prompt_speech"] is voice.speech  # the flow still clones the clip


def test_the_shipped_config_parses_with_its_knobs() -> None:
    from pathlib import Path

    from mstar.config import load_config

    config = load_config(Path(__file__).parents[2] / "configs" / "cosyvoice3.yaml")
    spec = CosyVoice3(config)
    assert spec.knobs.flow_estimator_dtype == "bfloat16" and spec.knobs.sentence_chunking
    assert {n for g in config.node_groups for n in g.node_names} == set(spec.graph().nodes)
