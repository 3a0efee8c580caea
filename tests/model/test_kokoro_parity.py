"""Parity of the kokoro family against the reference ``kokoro.KModel`` (kokoro==0.9.4), module
by module and end to end (``forward_with_tokens``), on a tiny random config, float32, CPU.

Bounds: durations equal; audio within 1e-4 of the reference's peak (the harmonic source's
random draws come from the same seed on both sides, see ``test_vocoder_parity.py``); the
intermediate features within 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.kokoro import KokoroConfig, KokoroModel
from mstar.model.kokoro.checkpoint import load_kokoro_state
from tests.support.kokoro import TINY_CONFIG, reference_model, released_state
from tests.support.vocoder import peak_err

pytest.importorskip("kokoro", reason="the reference: pip install kokoro==0.9.4")

AUDIO_TOL = 1e-4
FEATURE_TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = reference_model(tmp_path_factory.mktemp("kokoro"))
    ours = KokoroModel(KokoroConfig.from_dict(TINY_CONFIG)).eval()
    load_kokoro_state(ours, released_state(ref))
    return ref, ours


def token_ids(n: int, seed: int) -> torch.Tensor:
    """``n`` phoneme ids between the two boundary pads (id 0), as KModel.forward builds them."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.randint(1, TINY_CONFIG["n_token"] - 1, (n,), generator=g)
    return torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.zeros(1, dtype=torch.long)])[None]


def voice(seed: int) -> torch.Tensor:
    return torch.randn(1, 256, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_plbert_and_text_encoder(pair):
    ref, ours = pair
    ids = token_ids(11, 0)
    n = ids.shape[1]
    with torch.no_grad():
        want = ref.bert(ids, attention_mask=torch.ones_like(ids))
        got = ours.bert(ids)
        assert peak_err(got, want) <= FEATURE_TOL
        lengths, pad = torch.tensor([n]), torch.zeros(1, n, dtype=torch.bool)
        want = ref.text_encoder(ids, lengths, pad)
        assert peak_err(ours.text_encoder(ids, lengths, pad), want) <= FEATURE_TOL


def test_duration_encoder_and_f0_n(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(3)
    d_en, s = torch.randn(1, 512, 9, generator=g), torch.randn(1, 128, generator=g)
    lengths, pad = torch.tensor([9]), torch.zeros(1, 9, dtype=torch.bool)
    with torch.no_grad():
        want = ref.predictor.text_encoder(d_en, s, lengths, pad)
        assert peak_err(ours.predictor.text_encoder(d_en, s, lengths, pad), want) <= FEATURE_TOL
        frames = torch.randn(1, 640, 17, generator=g)
        for got, expect in zip(ours.predictor.f0_n(frames, s), ref.predictor.F0Ntrain(frames, s)):
            assert peak_err(got, expect) <= FEATURE_TOL


def test_decoder_waveform(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(4)
    frames = 12
    asr = torch.randn(1, 512, frames, generator=g)
    f0 = 100 + 150 * torch.rand(1, 2 * frames, generator=g)
    f0[:, :4] = 0
    energy, s = torch.randn(1, 2 * frames, generator=g), torch.randn(1, 128, generator=g)
    with torch.no_grad():
        torch.manual_seed(9)
        want = ref.decoder(asr, f0, energy, s)
        got = ours.decoder(asr, f0, energy, s, generator=torch.Generator().manual_seed(9))
    assert peak_err(got, want) <= AUDIO_TOL


@pytest.mark.parametrize(("n", "speed"), [(7, 1.0), (19, 1.3), (30, 0.8)])
def test_forward_with_tokens(pair, n: int, speed: float):
    ref, ours = pair
    ids, ref_s = token_ids(n, n), voice(n)
    torch.manual_seed(21)
    want_audio, want_dur = ref.forward_with_tokens(ids, ref_s, speed)
    (got_audio,), got_dur = ours(ids, ref_s, speed, generators=[torch.Generator().manual_seed(21)])
    assert torch.equal(got_dur[0], want_dur)
    assert len(set(want_dur.tolist())) >= 3  # durations vary: the alignment is exercised
    err = peak_err(got_audio, want_audio)
    print(f"[kokoro parity] {n} phonemes, speed {speed}: {err:.2e} of peak, {got_audio.numel()} samples")
    assert err <= AUDIO_TOL


@pytest.mark.slow
def test_kokoro_82m_shapes(tmp_path):
    """The released shapes (12-layer PL-BERT, 3-layer predictor and text encoder, max_dur 50,
    the 10x6 generator with a 20-point iSTFT), random weights; durations kept short (a
    duration bias of -3) so the audio stays small."""
    from mstar.model.kokoro.checkpoint import dummy_config

    config = dummy_config().to_dict() | {"multispeaker": True, "dim_in": 64, "max_conv_dim": 512}
    ref = reference_model(tmp_path, config=config, seed=1)
    with torch.no_grad():
        ref.predictor.duration_proj.linear_layer.bias.fill_(-3.0)
    ours = KokoroModel(KokoroConfig.from_dict(config)).eval()
    load_kokoro_state(ours, released_state(ref))
    vocab = config["vocab"]
    ids = torch.tensor([[0, *(vocab[p] for p in "ðə kˈæt sˈæt."), 0]])
    ref_s = voice(7)
    torch.manual_seed(3)
    want, want_dur = ref.forward_with_tokens(ids, ref_s, 1.0)
    (got,), got_dur = ours(ids, ref_s, 1.0, generators=[torch.Generator().manual_seed(3)])
    assert torch.equal(got_dur[0], want_dur)
    err = peak_err(got, want)
    print(f"[kokoro parity] Kokoro-82M shapes: {err:.2e} of peak, {got.numel()} samples")
    assert err <= AUDIO_TOL
