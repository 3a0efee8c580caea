"""The talker engine: sessions batched equal their solo runs (per-session seeded noise, a
warm-up prefilled beside other sessions' decodes), and every page and codec slot is freed."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.page_pool import OutOfPages
from mstar.model.eartts.engine import Sampling, TalkerEngine, Warmup
from tests.model.eartts.eartts_fixture import built, reference

STEPS = 5


@pytest.fixture(scope="module")
def model():
    return built(reference())


def _warmup(model, seed: int) -> Warmup:
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config.talker
    length = 5
    codes = torch.randint(0, cfg.codebook_size, (length, cfg.num_quantizers), generator=gen)
    audio_mask = torch.zeros(length, dtype=torch.bool)
    audio_mask[-2:] = True
    codes[0] = codes[-2] = cfg.codebook_size
    text_mask = torch.zeros(length, dtype=torch.bool)
    text_mask[-3:] = True
    ids = torch.randint(0, model.talker.text.on.shape[0], (length,), generator=gen)
    return Warmup(codes, audio_mask, ids, text_mask, model.speakers["tiny"][0, :length])


def _tokens(seed: int) -> list[int]:
    return torch.randint(0, 20, (STEPS,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def _solo(model, seed: int, sampling: Sampling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    engine = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4)
    engine.open("x", _warmup(model, seed), seed=seed, sampling=sampling)
    codes, pcm = [], []
    for token in _tokens(seed):
        frame = engine.step({"x": token})["x"]
        codes.append(frame.codes)
        pcm.append(frame.pcm)
    pcm.append(engine.close("x"))
    return torch.stack(codes), torch.cat(pcm)


@torch.no_grad()
def test_batched_sessions_equal_solo(model):
    """Session a starts alone; b joins a step later (its warm-up prefill packed with a's
    decode), c with other sampling knobs; each equals its own solo run."""
    greedier = Sampling(guidance=0.0, top_p=4, noise_scale=0.5)
    solo = {"a": _solo(model, 1), "b": _solo(model, 2), "c": _solo(model, 3, greedier)}
    engine = TalkerEngine(model, max_sessions=3, num_pages=24, page_size=4)
    seeds, tokens = {"a": 1, "b": 2, "c": 3}, {s: _tokens(seed) for s, seed in {"a": 1, "b": 2, "c": 3}.items()}
    codes = {s: [] for s in seeds}
    pcm = {s: [] for s in seeds}
    engine.open("a", _warmup(model, 1), seed=1)
    for step in range(STEPS + 1):
        if step == 1:
            engine.open("b", _warmup(model, 2), seed=2)
            engine.open("c", _warmup(model, 3), seed=3, sampling=greedier)
        live = {s: tokens[s][len(codes[s])] for s in seeds if s in engine.sessions and len(codes[s]) < STEPS}
        for sid, frame in engine.step(live).items():
            codes[sid].append(frame.codes)
            pcm[sid].append(frame.pcm)
        for sid in [s for s in live if len(codes[s]) == STEPS]:
            pcm[sid].append(engine.close(sid))
    for sid, (solo_codes, solo_pcm) in solo.items():
        assert torch.equal(torch.stack(codes[sid]), solo_codes), sid
        # Codes equal; PCM within 1e-4 of peak (batched convolutions sum in another order).
        torch.testing.assert_close(torch.cat(pcm[sid]), solo_pcm, atol=1e-4 * float(solo_pcm.abs().max()), rtol=0)
    assert engine.pages_used == 0 and engine.slots_used == 0
    assert not torch.equal(solo["a"][0], solo["b"][0])


@torch.no_grad()
def test_released_slot_is_fresh_for_the_next_session(model):
    """A session opened in a slot another session used speaks as it does alone."""
    engine = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4)
    engine.open("first", _warmup(model, 5), seed=5)
    for token in _tokens(5)[:3]:
        engine.step({"first": token})
    engine.close("first")
    assert engine.pages_used == 0 and engine.slots_used == 0
    engine.open("x", _warmup(model, 1), seed=1)
    frames = [engine.step({"x": token})["x"] for token in _tokens(1)]
    codes, pcm = _solo(model, 1)
    assert torch.equal(torch.stack([f.codes for f in frames]), codes)
    torch.testing.assert_close(torch.cat([*(f.pcm for f in frames), engine.close("x")]), pcm, atol=1e-5, rtol=0)


def test_open_refuses_past_the_pool(model):
    engine = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4)
    engine.open("never", _warmup(model, 1), seed=1)
    assert engine.close("never").numel() == 0 and engine.step({}) == {}  # a call that said nothing
    engine.open("a", _warmup(model, 1), seed=1)
    with pytest.raises(Exception, match="slot"):
        engine.open("b", _warmup(model, 2), seed=2)
    with pytest.raises(ValueError, match="already open"):
        engine.open("a", _warmup(model, 1), seed=1)


def test_speaker_warmup_layout(model):
    """The reference's 3 s speaker warm-up: 37 positions (the first step makes 38), text
    ``eos, pad...`` shifted, audio from the second-to-last frame, pad codes where it puts them."""
    q, cb = model.config.talker.num_quantizers, model.config.talker.codebook_size
    silence = torch.arange(q) % cb
    latent = torch.randn(1, 37, model.config.talker.hidden_size)
    w = Warmup.for_speaker(latent, silence, prompt_frames=37, text_pad_id=7, text_eos_id=9, codebook_size=cb)
    assert w.codes.shape == (37, q) and w.speaker.shape == (37, model.config.talker.hidden_size)
    assert w.text_ids.tolist() == [7] * 36 + [9]
    assert w.audio_mask.nonzero().flatten().tolist() == [36] and w.text_mask.nonzero().flatten().tolist() == [35, 36]
    assert (w.codes[0] == cb).all() and (w.codes[36] == cb).all() and torch.equal(w.codes[1], silence)
    engine = TalkerEngine(model, max_sessions=1, num_pages=16, page_size=4)
    engine.open("x", w, seed=0)
    with pytest.raises(OutOfPages):  # 2 x 10 pages: refused whole, nothing reserved
        engine.step({"x": 3})
    assert engine.pages_used == 0 and engine.sessions["x"].length == 0
    engine.close("x")
    engine = TalkerEngine(model, max_sessions=1, num_pages=20, page_size=4)
    engine.open("x", w, seed=0)
    frame = engine.step({"x": 3})["x"]
    assert frame.codes.shape == (q,) and engine.sessions["x"].length == 38
    assert frame.pcm.shape[0] == model.config.codec.wav_to_token_ratio - model.config.codec.overlap // 2


@torch.no_grad()
def test_text_eos_speaks_from_the_silence_frame(model):
    """With ``text_eos_id``, an EOS token's step takes the silence frame as previous codes."""
    eos = 3
    forced = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4, text_eos_id=eos)
    plain = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4)
    for engine in (forced, plain):
        engine.open("x", _warmup(model, 1), seed=1)
        engine.step({"x": 5})
    plain.sessions["x"].prev = model.silence_codes.clone()
    a, b = forced.step({"x": eos})["x"], plain.step({"x": eos})["x"]
    assert torch.equal(a.codes, b.codes)


def test_kv_pages_per_session_at_released_sizes():
    assert TalkerEngine.kv_pages_per_session(max_frames=2000, warmup=37, page_size=128) == 32


@torch.no_grad()
def test_padded_head_dim_is_exact(model):
    """A KV pool wider than the head dim (FlashInfer's 128 for the talker's 72; here 32 for
    18) gives the same frames."""
    runs = []
    for width in (None, 32):
        engine = TalkerEngine(model, max_sessions=1, num_pages=8, page_size=4, kv_head_dim=width)
        engine.open("x", _warmup(model, 1), seed=1)
        runs.append([engine.step({"x": t})["x"] for t in (1, 2, 3)])
    for plain, padded in zip(*runs, strict=True):
        assert torch.equal(plain.codes, padded.codes)
        torch.testing.assert_close(plain.pcm, padded.pcm, atol=1e-5, rtol=0)
