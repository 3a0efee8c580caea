"""The Qwen3-TTS declaration without a server: the four keys' deployment YAMLs parse and make
the graph; each variant's request rules (a built-in voice, a described voice, cloning by x-vector
or in context), the text layout, the budget, and sentence chunking of long inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.config import load_config, parse_config
from mstar.contract import GenerateSpec, RequestError, SpeechSpec, VoiceClip
from mstar.model.registry import model_class
from tests.support.qwen3_tts_dir import write_checkpoint

KEYS = ("qwen3_tts", "qwen3_tts_1p7b", "qwen3_tts_voicedesign", "qwen3_tts_base")
VARIANTS = {"qwen3_tts": "custom_voice", "qwen3_tts_voicedesign": "voice_design", "qwen3_tts_base": "base"}


@pytest.mark.parametrize("key", KEYS)
def test_deployment_yaml_makes_the_graph(key: str) -> None:
    config = load_config(Path(__file__).resolve().parents[3] / "configs" / f"{key}.yaml", {"device": "cpu"})
    spec = model_class(config.model)(config)
    assert set(spec.graph().walks) == {"tts"} and spec.tasks == {"speech"} and spec.key == key
    assert spec.knobs.codec_chunk_schedule == [1, 3, 8, 16] and spec.knobs.codec_left_context == 72


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def spec(request, tmp_path_factory):
    key = request.param
    root = write_checkpoint(tmp_path_factory.mktemp(key), VARIANTS[key])
    config = parse_config({"model": key, "model_path": str(root), "load_format": "dummy", "device": "cpu",
                           "max_seq_len": 512, "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}],
                           "model_kwargs": {"max_new_frames": 30}})
    spec = model_class(key)(config)
    spec.load_frontend()
    return spec


def speech(text: str = "Hello there.", **kwargs) -> SpeechSpec:
    return SpeechSpec("r", text, **kwargs)


def test_variant_rules(spec) -> None:
    variant = spec.tts.tts_model_type
    if variant == "custom_voice":
        assert spec.voices() == ["ryan", "vivian"]
        request = spec.prepare_speech(speech(voice="Ryan", model_kwargs={"seed": 1}))
        assert request.params["speaker"] == "ryan" and request.params["max_new_tokens"] == 30
        assert request.params["non_streaming"] is True and request.params["instruct_ids"] == []
        assert spec.prepare_speech(speech(model_kwargs={"non_streaming_mode": False})).params["non_streaming"] is False
        with pytest.raises(RequestError, match="voice"):
            spec.prepare_speech(speech(voice="nobody"))
    elif variant == "voice_design":
        assert spec.voices() == []
        with pytest.raises(RequestError) as err:
            spec.prepare_speech(speech(voice="anything"))
        assert err.value.field == "instructions"
        request = spec.prepare_speech(speech(model_kwargs={"instructions": "A calm low voice."}))
        assert request.params["speaker"] is None and len(request.params["instruct_ids"]) > 5
    else:
        t = np.arange(16000) / 16000
        pcm = (0.3 * np.sin(2 * np.pi * 200 * t)).astype("<f4").tobytes()
        for reference, kwargs, field in [(None, {}, "ref_audio"), (VoiceClip(pcm, 16000), {}, "ref_text"),
                                         (VoiceClip(pcm, 16000, "  "), {}, "ref_text"),
                                         (VoiceClip(pcm[:400], 16000), {"x_vector_only_mode": True}, "ref_audio")]:
            with pytest.raises(RequestError) as err:
                spec.prepare_speech(speech(reference=reference, model_kwargs=kwargs))
            assert err.value.field == field
        x_vector = {"x_vector_only_mode": True}
        request = spec.prepare_speech(speech(reference=VoiceClip(pcm, 16000), model_kwargs=x_vector))
        embed = request.inputs["speaker_embed"]
        assert embed.shape == (32,) and request.params["non_streaming"] is False  # base: text fed per frame
        assert request.inputs["ref_codes"].numel() == 0 and request.params["ref_ids"] is None
        again = spec.prepare_speech(speech(reference=VoiceClip(pcm, 16000), model_kwargs=x_vector))
        assert again.inputs["speaker_embed"] is embed  # memoised by content
        with pytest.raises(RequestError) as err:  # 1 s is 500 frames here: too many for max_seq_len 512
            spec.prepare_speech(speech(reference=VoiceClip(pcm, 16000, "Hi there.")))
        assert err.value.field == "ref_audio" and "500 codec frames" in err.value.message
        # in context: the clip's codes (0.2 s at 24 kHz, 48 samples a frame) and its transcript's ids
        short = pcm[:3200 * 4]
        icl = spec.prepare_speech(speech(reference=VoiceClip(short, 16000, "Hi there."), model_kwargs={"seed": 1}))
        codes = icl.inputs["ref_codes"]
        assert codes.shape == (100, 4) and codes.dtype == torch.int64 and int(codes.max()) < 64
        assert len(codes.unique()) > 1
        assert spec.tokenizer.decode(icl.params["ref_ids"]) == "Hi there."
        assert icl.prompt_tokens == request.prompt_tokens + len(icl.params["ref_ids"]) + 100 + 2
        x_only = spec.prepare_speech(speech(reference=VoiceClip(short, 16000, "Other words."), model_kwargs=x_vector))
        assert x_only.inputs["speaker_embed"] is icl.inputs["speaker_embed"]  # one memo entry per clip's audio
        other = spec.prepare_speech(speech(reference=VoiceClip(short, 16000, "Other words."), model_kwargs={}))
        assert other.inputs["ref_codes"] is codes and other.params["ref_ids"] != icl.params["ref_ids"]


def test_generate_requests(spec) -> None:
    variant = spec.tts.tts_model_type
    kwargs = {"voice": "vivian"} if variant == "custom_voice" else \
        {"instructions": "A bright voice."} if variant == "voice_design" else {"x_vector_only_mode": True}
    t = np.arange(16000) / 16000
    clip = VoiceClip((0.3 * np.sin(2 * np.pi * 200 * t)).astype("<f4").tobytes(), 16000) if variant == "base" else None
    request = spec.prepare_generate(GenerateSpec("g", "Hello.", [], ["audio"], kwargs, reference=clip))
    assert request.walk == "tts" and request.inputs["prompt_ids"].numel() > 8
    with pytest.raises(RequestError) as err:
        spec.prepare_generate(GenerateSpec("g", "Hello.", [], ["text"], kwargs, reference=clip))
    assert err.value.field == "output_modalities"


def test_common_rules(spec) -> None:
    if spec.tts.tts_model_type != "custom_voice":
        return
    for kwargs, field in [({"model_kwargs": {"language": "klingon"}}, "language"), ({"speed": 1.5}, "speed"),
                          ({"model_kwargs": {"max_tokens": 1}}, "max_tokens"),
                          ({"model_kwargs": {"bogus": 1}}, "model_kwargs")]:
        with pytest.raises(RequestError) as err:
            spec.prepare_speech(speech(**kwargs))
        assert err.value.field == field, (kwargs, err.value.field)
    with pytest.raises(RequestError, match="input"):
        spec.prepare_speech(speech("   "))
    long = " ".join(f"This is sentence number {i} of a long text." for i in range(20))
    assert len(long) >= 600
    pieces = spec.prepare_speech(speech(long))
    assert isinstance(pieces, list) and len(pieces) > 1
    with pytest.raises(RequestError, match="max_seq_len"):  # whole, it outgrows the talker's window
        spec.prepare_speech(speech(long, sentence_chunking=False))
    short = "First sentence here. " * 25
    assert len(short) < 600 and not isinstance(spec.prepare_speech(speech(short[:200])), list)
    assert isinstance(spec.prepare_speech(speech(short, sentence_chunking=True)), list)
