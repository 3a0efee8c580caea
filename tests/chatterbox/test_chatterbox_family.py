"""The served Chatterbox family on tiny dummy weights, in process, on the CPU: what a request
speaks equals the parts composed by hand (T3's eager decode, the variant's token hand-off,
S3Gen's ``token2wav`` and PerTh, with the request's seed), for the built-in voice and for a
cloned clip (whose encoding runs once per content); and the request options are checked, a
bad one refused naming its field."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import RequestError, SamplingParams, SpeechSpec, VoiceClip
from mstar.model.chatterbox.checkpoint import ChatterboxCheckpoint
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.model import SAMPLING_DEFAULTS
from mstar.model.chatterbox.synthesis import clip_voice, vocode
from mstar.model.chatterbox.t3_decode import PagedSequences, T3Request, generate
from mstar.model.perth import PerthWatermarker
from mstar.model.registry import model_class
from mstar.model.speech_output import pcm_to_array
from mstar.runtime.launch import start

KEYS = {"chatterbox": "english", "chatterbox_multilingual": "multilingual", "chatterbox_turbo": "turbo"}
LIMIT = 40
TEXT = "Hello there, how are you?"


def deployment_config(key: str) -> dict:
    return {"model": key, "load_format": "dummy", "device": "cpu", "max_concurrent_requests": 8,
            "node_groups": [{"node_names": ["t3", "s3gen"], "ranks": [0]}],
            "model_kwargs": {"dummy_scale": "tiny", "max_new_tokens_limit": LIMIT}}


def clip(seconds: float = 6.0, rate: int = 22050, seed: int = 0) -> VoiceClip:
    """A voiced-sounding clip: a wobbling tone with noise, at a rate the family resamples."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t) + 0.02 * g.standard_normal(t.size)
    return VoiceClip(wave.astype("<f4").tobytes(), rate)


@pytest.fixture(scope="module", params=list(KEYS))
def served(request):
    key = request.param
    deployment = start(parse_config(deployment_config(key)), in_process=True)
    try:
        yield key, deployment
    finally:
        deployment.close()


def speak(deployment, spec: SpeechSpec) -> np.ndarray:
    async def run():
        return [e async for e in deployment.backend.speech(spec)]

    return pcm_to_array(asyncio.run(run()))


def by_hand(variant: str, voice, text_ids: list[int], seed: int, exaggeration: float = 0.5,
            cfg_weight: float = 0.5) -> np.ndarray:
    """The reference path, composed from the parts: T3's eager decode, then S3Gen and PerTh."""
    parts = ChatterboxCheckpoint(None, variant, dummy=True, tiny=True)
    t3, s3gen, config = parts.t3(), parts.s3gen(), parts.t3_config()
    sampling = SamplingParams(**SAMPLING_DEFAULTS[variant], seed=seed)
    request = T3Request(T3Conditioning(voice.speaker_emb, voice.prompt_tokens, exaggeration),
                        torch.tensor(text_ids), sampling, cfg_weight if config.guided else 0.0, LIMIT)
    tokens = generate(t3, request, PagedSequences(t3), torch.Generator().manual_seed(seed)).tokens
    marker = PerthWatermarker(parts.perth(None))
    return vocode(s3gen, config, tokens, voice.s3gen, seed, marker).numpy()


def spec_of(key: str):
    spec = model_class(key)(parse_config(deployment_config(key)))
    spec.load_frontend()
    return spec


def test_builtin_voice_equals_the_parts_by_hand(served):
    key, deployment = served
    variant = KEYS[key]
    got = speak(deployment, SpeechSpec("b", TEXT, None, 1.0, {"seed": 11, "exaggeration": 0.7}))
    parts = ChatterboxCheckpoint(None, variant, dummy=True, tiny=True)
    want = by_hand(variant, parts.builtin_voice(), parts.text_front().ids(TEXT, "en" if variant == "multilingual"
                                                                           else None), 11, exaggeration=0.7)
    assert got.size > 0 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))


def test_cloned_voice_equals_the_parts_by_hand(served):
    key, deployment = served
    variant = KEYS[key]
    reference = clip()
    got = speak(deployment, SpeechSpec("c", TEXT, None, 1.0, {"seed": 5}, reference=reference))
    parts = ChatterboxCheckpoint(None, variant, dummy=True, tiny=True)
    voice = clip_voice(parts.clip_encoders(), np.frombuffer(reference.pcm, "<f4"), reference.sample_rate,
                       parts.t3_config())
    want = by_hand(variant, voice, parts.text_front().ids(TEXT, "en" if variant == "multilingual" else None), 5)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    builtin = speak(deployment, SpeechSpec("d", TEXT, None, 1.0, {"seed": 5}))
    assert not np.array_equal(builtin, got)  # the clip, not the built-in voice, was used


def test_a_clip_is_encoded_once_and_its_prompt_is_aligned():
    spec = spec_of("chatterbox")
    reference = clip(seconds=3.0)
    first = spec.clip_conditioning(reference)
    assert spec.clip_conditioning(VoiceClip(reference.pcm, reference.sample_rate)) is first
    assert spec.clip_conditioning(VoiceClip(reference.pcm, reference.sample_rate, "Words.")) is first  # audio alone
    assert spec.clip_memo.misses == 1 and spec.clip_memo.hits == 2
    assert first.s3gen.mel.shape[1] == 2 * first.s3gen.tokens.shape[1] or \
        first.s3gen.tokens.shape[1] == first.s3gen.mel.shape[1] // 2
    assert 0 < first.prompt_tokens.shape[1] <= spec.t3_config.speech_cond_prompt_len
    assert torch.allclose(first.speaker_emb.norm(), torch.tensor(1.0))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"exaggeration": 2.5}, "exaggeration"),
    ({"cfg_weight": -0.1}, "cfg_weight"),
    ({"temperature": 6.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 3.0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": LIMIT + 1}, "max_new_tokens"),
    ({"watermark": "no"}, "watermark"),
    ({"language_id": "fr"}, "language_id"),
    ({"colour": "blue"}, "model_kwargs"),
])
def test_bad_options_are_refused_naming_the_field(kwargs, field):
    spec = spec_of("chatterbox")
    with pytest.raises(RequestError) as err:
        spec.prepare_speech(SpeechSpec("x", TEXT, None, 1.0, kwargs))
    assert err.value.field == field


def test_bad_requests_name_their_field():
    english, multilingual, turbo = (spec_of(key) for key in KEYS)
    cases = [
        (english, SpeechSpec("x", TEXT, "nobody", 1.0, {}), "voice"),
        (english, SpeechSpec("x", TEXT, None, 1.5, {}), "speed"),
        (english, SpeechSpec("x", "   ", None, 1.0, {}), "input"),
        (english, SpeechSpec("x", "word " * 100, None, 1.0, {}), "input"),
        (multilingual, SpeechSpec("x", TEXT, None, 1.0, {"language_id": "xx"}), "language_id"),
        (turbo, SpeechSpec("x", TEXT, None, 1.0, {}, reference=clip(seconds=3.0)), "ref_audio"),
        (english, SpeechSpec("x", TEXT, None, 1.0, {}, reference=clip(seconds=0.1)), "ref_audio"),
    ]
    for spec, request, field in cases:
        with pytest.raises(RequestError) as err:
            spec.prepare_speech(request)
        assert err.value.field == field, (request, err.value)
    walk = multilingual.prepare_speech(SpeechSpec("x", TEXT, None, 1.0, {"language_id": "FR", "seed": 1}))
    assert walk.params["seed"] == 1 and walk.params["max_new_tokens"] == LIMIT


def test_options_reach_the_walk():
    english, turbo = spec_of("chatterbox"), spec_of("chatterbox_turbo")
    walk = english.prepare_speech(SpeechSpec("x", TEXT, None, 1.0, {
        "exaggeration": 1.1, "cfg_weight": 0.0, "temperature": 0.5, "top_p": 0.9, "min_p": 0.1,
        "repetition_penalty": 1.5, "seed": 9, "max_new_tokens": 12, "watermark": False}))
    p = walk.params
    assert (p["exaggeration"], p["cfg_weight"], p["max_new_tokens"], p["seed"], p["watermark"]) == \
        (1.1, 0.0, 12, 9, False)
    assert p["sampling"] == {"temperature": 0.5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.5, "seed": 9}
    assert walk.cost["kv_pages"] < english.prepare_speech(SpeechSpec("y", TEXT, None, 1.0, {"max_new_tokens": 12})
                                                          ).cost["kv_pages"]  # no unconditional row
    assert turbo.prepare_speech(SpeechSpec("z", TEXT, None, 1.0, {"cfg_weight": 0.9})).params["cfg_weight"] == 0.0


def test_an_unknown_or_bad_deployment_knob_stops_startup_naming_it():
    from mstar.config import ConfigError

    for kwargs, name in (({"colour": 1}, "colour"), ({"variant": "klingon"}, "variant"),
                         ({"default_language": "xx"}, "default_language"), ({"watermark": "yes"}, "watermark"),
                         ({"max_new_tokens_limit": 0}, "max_new_tokens_limit")):
        config = deployment_config("chatterbox")
        config["model_kwargs"] = {**config["model_kwargs"], **kwargs}
        with pytest.raises(ConfigError, match=name):
            model_class("chatterbox")(parse_config(config))


def test_without_soxr_outputs_are_unmarked_and_the_log_says_so(monkeypatch, caplog):
    import sys

    spec = spec_of("chatterbox")
    parts = spec.checkpoint()
    assert isinstance(spec._watermarker(parts, torch.device("cpu")), PerthWatermarker)
    monkeypatch.setitem(sys.modules, "soxr", None)  # import soxr raises ImportError
    with caplog.at_level("WARNING"):
        assert spec._watermarker(parts, torch.device("cpu")) is None
    assert "NOT watermarked" in caplog.text and "soxr" in caplog.text


@pytest.mark.parametrize("key", ["chatterbox", "chatterbox_turbo"])
def test_streamed_chunks_cover_the_whole_utterance(key):
    """A ``stream: true`` request's audio comes in several pieces as T3 goes; they
    add up to the whole utterance's length (the same tokens: T3 does not see the chunking),
    the first piece ends on the held-back look-ahead, and a seeded request repeats exactly."""
    config = deployment_config(key)
    config["model_kwargs"] |= {"stream_first_chunk_tokens": 8, "stream_chunk_tokens": 8, "stream_max_chunk_tokens": 16}
    deployment = start(parse_config(config), in_process=True)
    try:
        async def run(request_id):
            return [e async for e in deployment.backend.speech(SpeechSpec(request_id, TEXT, None, 1.0, {"seed": 3},
                                                                                   stream=True))]

        pieces = [np.frombuffer(e.data, "<f4") for e in asyncio.run(run("s1")) if e.data]
        again = [np.frombuffer(e.data, "<f4") for e in asyncio.run(run("s2")) if e.data]
    finally:
        deployment.close()
    whole = ChatterboxCheckpoint(None, KEYS[key], dummy=True, tiny=True)
    parts = whole.text_front().ids(TEXT)
    t3 = whole.t3()
    request = T3Request(T3Conditioning(whole.builtin_voice().speaker_emb, whole.builtin_voice().prompt_tokens, 0.5),
                        torch.tensor(parts), SamplingParams(**SAMPLING_DEFAULTS[KEYS[key]], seed=3),
                        0.5 if t3.config.guided else 0.0, LIMIT)
    tokens = generate(t3, request, PagedSequences(t3), torch.Generator().manual_seed(3)).tokens
    want = vocode(whole.s3gen(), t3.config, tokens, whole.builtin_voice().s3gen, 3, None)
    assert len(pieces) > 2 and sum(len(p) for p in pieces) == len(want)
    assert all(len(p) % 480 == 0 for p in pieces)
    assert len(again) == len(pieces) and all(np.array_equal(a, b) for a, b in zip(pieces, again, strict=True))


def test_sentence_chunking_speaks_each_piece_as_alone():
    config = deployment_config("chatterbox")
    deployment = start(parse_config(config), in_process=True)
    first = "One rather long sentence, " + "with clause after clause, " * 9 + "ends here."
    second = "And another one, " + "on and on, " * 20 + "ends there."  # together over the 400 limit
    try:
        chunked = speak(deployment, SpeechSpec("p", f"{first} {second}", None, 1.0, {"seed": 4},
                                               sentence_chunking=True))
        alone = [speak(deployment, SpeechSpec(f"a{i}", text, None, 1.0, {"seed": 4}))
                 for i, text in enumerate((first, second))]
    finally:
        deployment.close()
    spec = spec_of("chatterbox")
    long = " ".join(["Short sentence number one."] * 20)
    assert len(spec.prepare_speech(SpeechSpec("q", long, None, 1.0, {}, sentence_chunking=True))) == 2
    assert len(spec.prepare_speech(SpeechSpec("r", f"{first} {second}", None, 1.0, {}, sentence_chunking=True))) == 2
    assert np.array_equal(chunked, np.concatenate(alone))
