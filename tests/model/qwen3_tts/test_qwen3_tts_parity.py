"""Parity of the Qwen3-TTS talker, code predictor and 12 Hz codec decoder with the reference
(``qwen-tts==0.1.1`` under transformers 4.57.3), on tiny random configs, fp32, CPU.

The reference cannot run beside our transformers, so ``record_reference.py`` (next to this
file) recorded its outputs into ``fixtures/``; each fixture holds the tiny model's weights
under their released names, so loading them also checks the key layout with coverage both
ways. Talker: two requests batched on shuffled KV pages, every step's codebook-0 logits, the
frame's codes and the code predictor's logits per group, for a predictor as wide as the talker
(0.6B) and a narrower one behind ``small_to_mtp_projection`` (1.7B). Codec: the whole decode,
the reference's chunked decode, and our streamed windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.qwen3_tts.checkpoint import load_codec, load_talker
from mstar.model.qwen3_tts.codec import Qwen3TTSCodec, stream_windows
from mstar.model.qwen3_tts.config import CodecConfig, TalkerConfig
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker
from mstar.model.weights import WeightLoadError
from tests.support.pages import Pages

FIXTURES = Path(__file__).parent / "fixtures"
TOL = 1e-5
AUDIO_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def read_fixture(name: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with safe_open(FIXTURES / f"{name}.safetensors", framework="pt") as f:
        config = json.loads(f.metadata()["config"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    weights = {k: v for k, v in tensors.items() if not k.startswith("fx.")}
    return config, weights, {k[3:]: v for k, v in tensors.items() if k.startswith("fx.")}


@pytest.mark.parametrize("name", ["talker_same_width", "talker_projected"])
@torch.no_grad()
def test_talker_steps_match_reference(name: str) -> None:
    """Two requests (prefills of 7 and 4 rows) in one batch, then five steps: codebook 0
    greedy from our logits, the frame from our code predictor, the next input its embedding
    sum plus the text row (or ``tts_pad``); every logit within 1e-5, every code equal."""
    config, weights, fx = read_fixture(name)
    talker = Qwen3TTSTalker.from_hf_dict(config).eval()
    load_talker(talker, weights.items())
    assert isinstance(talker.code_predictor.small_to_mtp_projection, torch.nn.Linear) == (name == "talker_projected")
    layers, heads, head_dim = talker.cache_shape()
    caches = allocate_kv_cache(layers, 16, 4, heads, head_dim, torch.float32, "cpu")
    pages, reqs = Pages(16, 4, seed=2), ("0", "1")
    hidden = talker(torch.cat([fx[f"{r}.prefill"] for r in reqs]), pages.step([(r, len(fx[f"{r}.prefill"]))
                                                                               for r in reqs]), caches)
    ends = torch.tensor([len(fx["0.prefill"]), len(fx["0.prefill"]) + len(fx["1.prefill"])]) - 1
    last = hidden[ends]
    worst = {"talker": 0.0, "predictor": 0.0}
    for step in range(5):
        logits = talker.compute_logits(last)
        for b, r in enumerate(reqs):
            worst["talker"] = max(worst["talker"], rel_err(logits[b], fx[f"{r}.logits"][step]))
        code0 = logits.argmax(dim=-1)
        predictor_logits: list[torch.Tensor] = []
        frame = talker.predict_frame(last, code0, logits_out=predictor_logits)
        for b, r in enumerate(reqs):
            assert torch.equal(frame.codes[b], fx[f"{r}.codes"][step]), f"request {r} step {step}"
            ours = torch.stack([g[b] for g in predictor_logits])
            worst["predictor"] = max(worst["predictor"], rel_err(ours, fx[f"{r}.predictor_logits"][step]))
        text = [fx[f"{r}.trailing"][step] if step < len(fx[f"{r}.trailing"]) else fx["tts_pad_embed"]
                for r in reqs]
        last = talker(frame.embeds + torch.stack(text), pages.step([(r, 1) for r in reqs]), caches)
    logits = talker.compute_logits(last)
    for b, r in enumerate(reqs):
        worst["talker"] = max(worst["talker"], rel_err(logits[b], fx[f"{r}.logits"][5]))
    assert max(worst.values()) < TOL, worst


def test_talker_config_and_coverage() -> None:
    config, weights, _ = read_fixture("talker_projected")
    parsed = TalkerConfig.from_hf_dict(config)
    assert (parsed.num_code_groups, parsed.predictor.hidden_size, parsed.spk_id["vivian"]) == (4, 24, 50)
    with pytest.raises(ValueError, match="num_code_groups"):
        TalkerConfig.from_hf_dict(dict(config, num_code_groups=5))
    with pytest.raises(NotImplementedError, match="rope_type"):
        TalkerConfig.from_hf_dict(dict(config, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    talker = Qwen3TTSTalker.from_hf_dict(config)
    with pytest.raises(WeightLoadError, match="code_predictor.lm_head.0"):
        load_talker(talker, [(k, v) for k, v in weights.items() if "lm_head.0" not in k])
    with pytest.raises(WeightLoadError, match="talker.extra"):
        load_talker(talker, [*weights.items(), ("talker.extra.weight", torch.zeros(1))])


@pytest.fixture(scope="module")
def codec_fixture() -> tuple[Qwen3TTSCodec, dict[str, torch.Tensor]]:
    config, weights, fx = read_fixture("codec")
    codec = Qwen3TTSCodec(CodecConfig.from_hf_dict({"decoder_config": config})).eval()
    load_codec(codec, weights.items())
    return codec, fx


@torch.no_grad()
def test_codec_whole_and_chunked_match_reference(codec_fixture) -> None:
    codec, fx = codec_fixture
    assert codec.samples_per_frame == 48 and fx["wav"].shape[-1] == 40 * 48
    assert rel_err(codec(fx["codes"]), fx["wav"]) < AUDIO_TOL
    assert rel_err(codec.chunked_decode(fx["codes"], chunk_size=7, left_context=5), fx["chunked"]) < AUDIO_TOL


@torch.no_grad()
def test_codec_window_decodes_only_new_frames(codec_fixture) -> None:
    """A window's new frames through the conv stack behind ``conv_reach`` frames equal the
    whole window's decode less the context."""
    codec, fx = codec_fixture
    codes, spf = fx["codes"][..., :30], codec.samples_per_frame
    # ConvNeXt 6/2 and 6/4, conv 6/4, block 1/4 + 78/16, block 1/16 + 78/48, conv 6/48: 12.94
    assert codec.conv_reach == 13
    whole = codec(codes)
    for context in (0, 3, 12, 25):
        assert rel_err(codec.decode_window(codes, context), whole[..., context * spf:]) < 1e-6


@torch.no_grad()
def test_codec_stream_joined_equals_whole_decode(codec_fixture) -> None:
    """The ramp 1/3/8/16/25: with a left context covering the transformer's and the conv
    stack's reach, the joined windows equal the whole decode and the reference's; with a
    shorter context, the reference's own chunked decode with that context."""
    codec, fx = codec_fixture
    codes = fx["codes"]
    assert stream_windows(60, left_context=72) == [(0, 0, 1), (1, 1, 3), (4, 4, 8), (12, 12, 16), (28, 28, 25),
                                                   (53, 53, 7)]
    assert stream_windows(40, ramp=(2, 5), left_context=4) == [(0, 0, 2), (2, 2, 5), (7, 4, 5), (12, 4, 5),
                                                               (17, 4, 5), (22, 4, 5), (27, 4, 5), (32, 4, 5),
                                                               (37, 4, 3)]
    joined = torch.cat(list(codec.decode_stream(codes)), dim=-1)
    assert rel_err(joined, fx["wav"]) < AUDIO_TOL  # 72 frames of context: the whole clip
    reach = 2 * 5 + 2 + codec.conv_reach  # two layers of a 6-frame window, pre_conv, conv stack
    joined = torch.cat(list(codec.decode_stream(codes, ramp=(1, 3, 8), left_context=reach)), dim=-1)
    assert rel_err(joined, fx["wav"]) < AUDIO_TOL
    short = torch.cat(list(codec.decode_stream(codes, ramp=(7,), left_context=5)), dim=-1)
    assert rel_err(short, fx["chunked"]) < AUDIO_TOL
    assert rel_err(fx["chunked"], fx["wav"]) > 1e-2  # a short context is audibly not the whole decode
    assert (fx["wav"].abs() > 0.999).float().mean() < 0.01  # the fixture's audio is not clamped flat


@torch.no_grad()
def test_speaker_encoder_matches_reference() -> None:
    """The base checkpoints' x-vector of a 0.6 s clip: mel front end and ECAPA-TDNN."""
    from mstar.model.qwen3_tts.checkpoint import load_speaker_encoder
    from mstar.model.qwen3_tts.config import SpeakerEncoderConfig
    from mstar.model.qwen3_tts.speaker import Qwen3TTSSpeakerEncoder

    config, weights, fx = read_fixture("speaker")
    encoder = Qwen3TTSSpeakerEncoder(SpeakerEncoderConfig.from_hf_dict(config)).eval()
    load_speaker_encoder(encoder, weights.items())
    assert rel_err(encoder.embed_clip(fx["clip"].numpy()), fx["embedding"]) < TOL
    with pytest.raises(WeightLoadError, match="fc.weight"):
        load_speaker_encoder(encoder, [(k, v) for k, v in weights.items() if not k.startswith("speaker_encoder.fc")])
