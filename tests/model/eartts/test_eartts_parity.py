"""EarTTS talker and codec against NeMo 3.0.0's reference (fixtures recorded by
``record_reference.py``; tiny random config, fp32, CPU): warm-up and per-frame hidden states,
sampled codes for the reference's own noise draws, and the codec's PCM."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.eartts.engine import TalkerEngine, Warmup
from mstar.model.eartts.talker import FrameNoise
from tests.model.eartts.eartts_fixture import built, contiguous_meta, reference


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def model(ref):
    return built(ref)


def _warmup(ref: dict, b: int) -> Warmup:
    w = ref["warmup"]
    return Warmup(w["code"][b], w["audio_mask"][b], w["subword_ids"][b], w["subword_mask"][b], w["prompt_latent"][b])


def _noise(ref: dict, step: int, rows) -> FrameNoise:
    n = ref["steps"]["noise"][step]
    return FrameNoise(n["gumbel"][:, rows], n["gauss"][:, rows])


@torch.no_grad()
def test_talker_hidden_and_codes_match_reference(model, ref):
    """Warm-up prefill of both CFG streams, then four frames fed the reference's codes: each
    frame's hidden states within 1e-5 and its codes equal for the same noise."""
    talker, cfg = model.talker, model.config.talker
    w, steps = ref["warmup"], ref["steps"]
    batch, warm = w["code"].shape[:2]
    capacity = warm + steps["ids"].shape[1]
    kv = allocate_kv_cache(cfg.num_hidden_layers, 2 * batch, capacity, cfg.num_key_value_heads, cfg.head_dim,
                           torch.float32, "cpu")
    # Streams in the reference's order: the conditional rows, then the unconditional ones.
    rows = [(b, uncond) for uncond in (False, True) for b in range(batch)]
    embeds = []
    for b, uncond in rows:
        audio = talker.warmup_code_embeds(w["code"][b], w["audio_mask"][b], w["prompt_latent"][b])
        text = talker.text(w["subword_ids"][b], w["subword_mask"][b])
        embeds.append(talker.fuse(audio, text, torch.full((warm,), uncond)))
    hidden = talker.hidden(torch.cat(embeds), contiguous_meta([0] * 4, [warm] * 4, capacity), kv)
    torch.testing.assert_close(hidden.view(4, warm, -1), w["hidden"], atol=1e-5, rtol=0)

    prev = w["code"][:, -1]
    for t in range(steps["ids"].shape[1]):
        ids = steps["ids"][:, t]
        audio = talker.code_embeds(prev)
        text = talker.text(ids, torch.ones(batch, dtype=torch.bool))
        inputs = torch.cat([talker.fuse(audio, text, torch.zeros(batch, dtype=torch.bool)),
                            talker.fuse(audio, text, torch.ones(batch, dtype=torch.bool))])
        hidden = talker.hidden(inputs, contiguous_meta([warm + t] * 4, [1] * 4, capacity), kv)
        torch.testing.assert_close(hidden, steps["hidden"][:, t], atol=1e-5, rtol=0)  # cond rows, then uncond
        codes = talker.sample_codes(hidden[:batch], hidden[batch:], _noise(ref, t, slice(None)),
                                    guidance=cfg.guidance_scale, top_p=cfg.top_p, noise_scale=cfg.noise_scale)
        assert torch.equal(codes, steps["codes"][:, t])
        prev = steps["codes"][:, t]


@torch.no_grad()
def test_engine_codes_and_pcm_match_reference(model, ref):
    """The engine (warm-up prefilled with the first token, paged KV, codec in the step) gives
    the reference's codes for its noise, and its frames' PCM is the reference codec's."""
    engine = TalkerEngine(model, max_sessions=2, num_pages=16, page_size=4)
    steps = ref["steps"]
    for b in range(2):
        engine.open(f"s{b}", _warmup(ref, b), seed=b)
    pcm = {f"s{b}": [] for b in range(2)}
    for t in range(steps["ids"].shape[1]):
        tokens = {f"s{b}": int(steps["ids"][b, t]) for b in range(2)}
        frames = engine.step(tokens, noise={f"s{b}": _noise(ref, t, [b]) for b in range(2)})
        for b in range(2):
            assert torch.equal(frames[f"s{b}"].codes, steps["codes"][b, t])
            pcm[f"s{b}"].append(frames[f"s{b}"].pcm)
    ratio = model.config.codec.wav_to_token_ratio
    expected = model.codec.decode(steps["codes"])  # checked against the reference below
    for b in range(2):
        streamed = torch.cat([*pcm[f"s{b}"], engine.close(f"s{b}")])
        assert streamed.shape[0] == steps["codes"].shape[1] * ratio
        torch.testing.assert_close(streamed, expected[b], atol=1e-4 * float(expected.abs().max()), rtol=0)
    assert engine.pages_used == 0 and engine.slots_used == 0


@torch.no_grad()
def test_codec_matches_reference_and_streams(model, ref):
    """The whole decode within 1e-4 of peak of NeMo's; frame-by-frame through the state it
    equals the whole decode (1e-4 of peak; measured ~1e-5), frame counts 1758, 1764, ..., then 6."""
    codes, expected = ref["codec"]["codes"], ref["codec"]["pcm"]
    peak = float(expected.abs().max())
    whole = model.codec.decode(codes)
    assert whole.shape == expected.shape
    torch.testing.assert_close(whole, expected, atol=1e-4 * peak, rtol=0)

    codec = model.codec
    state = codec.new_state(codes.shape[0])
    pieces = []
    for t in range(codes.shape[1]):
        out, lead, state = codec.step(codes[:, t:t + 1], state)
        assert int(lead[0]) == (codec.config.overlap // 2 if t == 0 else 0)
        pieces.append(out[:, int(lead[0]):])
    pieces.append(codec.flush(state))
    streamed = torch.cat(pieces, dim=1)
    torch.testing.assert_close(streamed, whole, atol=1e-4 * peak, rtol=0)
    # Chunks of two frames from a mid-call state give the same samples as well.
    state = codec.new_state(codes.shape[0])
    out0, lead0, state = codec.step(codes[:, :3], state)
    out1, _, state = codec.step(codes[:, 3:], state)
    chunked = torch.cat([out0[:, int(lead0[0]):], out1, codec.flush(state)], dim=1)
    torch.testing.assert_close(chunked, whole, atol=1e-4 * peak, rtol=0)
