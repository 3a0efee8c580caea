"""Chatterbox's voice encoder (``mstar.model.speech_front.voice_encoder``) against
``chatterbox-tts``'s ``models/voice_encoder``.

The reference outputs are in ``fixtures/voice_encoder.pt``, recorded by ``record_reference.py``
with ``chatterbox-tts==0.1.7`` and ``librosa==0.11.0`` on ``torch==2.9.1`` (chatterbox pins
torch 2.6 and numpy < 2). The embeddings are ``VoiceEncoder.embeds_from_wavs(clips,
sample_rate=16000)``, the call ``ChatterboxTTS.prepare_conditionals`` makes (silence trimmed at
20 dB, partials at rate 1.3), for a tiny random encoder (LSTM 16, 8-d embedding) and one of the
released size (LSTM 3 x 256, 256-d), float32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.model.speech_front import (
    VoiceEncoder,
    VoiceEncoderConfig,
    mel_power,
    partial_windows,
    trim_silence,
    voice_encoder_name_map,
)
from mstar.model.weights import WeightLoadError, load_weights
from tests.support.speech_front import FIXTURES, clips, max_rel_error, seeded_state

REF = torch.load(FIXTURES / "voice_encoder.pt")
MEL_TOL = 1e-5  # of the reference's peak (librosa's STFT runs in float64)
EMBED_TOL = 1e-5


def encoder(name: str) -> VoiceEncoder:
    config = VoiceEncoderConfig(**REF["tiny_config"]) if name == "tiny" else VoiceEncoderConfig()
    model = VoiceEncoder(config).eval()
    weights = seeded_state(REF[name]["keys"], seed=3 if name == "tiny" else 4)
    load_weights(model, weights.items(), name_map=voice_encoder_name_map())  # strict: coverage both ways
    return model


def test_mel_power_matches_librosa():
    for wave, ref in zip(clips(), REF["mel"], strict=True):
        ours = mel_power(wave).T
        assert ours.shape == ref.shape
        err = max_rel_error(ours, ref)
        assert err < MEL_TOL, f"mel max error {err:.2e}"


def test_trim_matches_librosa():
    for wave, (start, end) in zip(clips(), REF["trim"], strict=True):
        trimmed = trim_silence(wave, 20.0)
        assert trimmed.shape[0] == end - start
        assert torch.equal(trimmed, wave[start:end])
    assert REF["trim"][0][0] > 0  # the first clip opens with near-silence, and it is cut


def test_partial_windows_count():
    # 301 frames: two whole windows every 77 frames, and a third covering 92 % of itself
    assert partial_windows(301, 77, 160, 0.8) == (3, 314)
    assert partial_windows(100, 77, 160, 0.8) == (1, 160)  # always one, padded
    assert partial_windows(250, 77, 160, 0.8) == (2, 237)  # the tail would cover 57 %: dropped


@pytest.mark.parametrize("name", ["tiny", "full"])
def test_embeddings_match(name):
    ours = encoder(name)(clips())
    ref = REF[name]["embeddings"]
    assert ours.shape == ref.shape
    err = max_rel_error(ours, ref)
    assert err < EMBED_TOL, f"{name}: embedding max error {err:.2e}"
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(ref)))


def test_batched_equals_one_at_a_time():
    model = encoder("tiny")
    together = model(clips())
    alone = torch.cat([model([clip]) for clip in clips()])
    assert (together - alone).abs().max() < 1e-6


def test_loads_ve_safetensors_and_names_mismatches(tmp_path):
    """``ve.safetensors`` is the reference's whole state dict, the unused similarity scale too."""
    state = seeded_state(REF["full"]["keys"], seed=4)
    assert {"similarity_weight", "similarity_bias"} <= state.keys()
    save_file(state, tmp_path / "ve.safetensors")
    model = VoiceEncoder().eval()
    load_weights(model, load_file(tmp_path / "ve.safetensors").items(), name_map=voice_encoder_name_map())
    assert max_rel_error(model(clips()[1:2])[0], REF["full"]["embeddings"][1]) < EMBED_TOL

    state["lstm.weight_hh_l3"] = state.pop("lstm.weight_hh_l2")
    with pytest.raises(WeightLoadError, match=r"lstm\.weight_hh_l2.*lstm\.weight_hh_l3"):
        load_weights(model, state.items(), name_map=voice_encoder_name_map())


def test_silent_clip_is_kept_whole():
    """librosa's rule: the loudest hop is 0 dB, so silence is never all cut."""
    assert trim_silence(torch.zeros(5000), 20.0).shape == (5000,)
