"""The PerTh watermark (``mstar.model.perth``) against ``resemble-perth==1.0.1``.

The reference outputs are fixtures recorded by ``record_reference.py`` (the package needs
torchaudio, which has no torch 2.13 build; the script's docstring says how it was run: torch
2.13.0 CPU, torchaudio 2.11.1's Python transforms, librosa 0.11.0, soxr 1.1.0). A tiny random
network (hidden 8, 256-point STFT, hop 40), float32 on the CPU; errors are relative to the
reference's peak.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mstar.model.perth import PerthConfig, PerthNet, PerthWatermarker, load_perth, loud_frames
from mstar.model.weights import WeightLoadError
from tests.perth.tiny import FIXTURES, TINY, tiny_net
from tests.support.vocoder import peak_err

WAVE_TOL = 1e-4
SCORE_TOL = 1e-5


def test_marking_at_the_network_rate_matches_reference():
    ref = TINY[32000]
    marked = PerthWatermarker(tiny_net()).apply(ref["clip"], 32000)
    assert marked.shape == ref["marked"].shape
    assert peak_err(marked, ref["marked"]) < WAVE_TOL
    assert peak_err(ref["clip"], ref["marked"]) > 1e-3  # the mark changed the clip


def test_marking_at_24khz_matches_reference():
    """S3Gen's rate: soxr to 32 kHz and back around the network, as librosa does."""
    pytest.importorskip("soxr", reason="the reference's resampler: pip install soxr")
    ref = TINY[24000]
    marked = PerthWatermarker(tiny_net()).apply(ref["clip"], 24000)
    assert peak_err(marked, ref["marked"]) < WAVE_TOL


@pytest.mark.parametrize("rate", [32000, 24000])
@pytest.mark.parametrize("which", ["marked", "clean"])
def test_detection_score_matches_reference(rate, which):
    """24 kHz clips are brought to 32 kHz by scipy's polyphase filter, as the reference does."""
    ref = TINY[rate]
    wave = ref["marked"] if which == "marked" else ref["clip"]
    score = PerthWatermarker(tiny_net()).score(wave, rate)
    assert 0 < ref[f"score_{which}"] < 1  # not at the clip bounds
    assert abs(score.item() - ref[f"score_{which}"]) < SCORE_TOL


def test_silent_frames_carry_no_mark():
    """Frames of digital silence (the scaled magnitude sums to 0) get no mark; the clip's
    quiet stretch (-80 dB) still does: the threshold is 5 % of the loudest frame on a scale
    where 0 is -180 dB."""
    net = tiny_net()
    wave = TINY[32000]["clip"].clone()
    wave[-2000:] = 0
    magnitude, _ = net.analyse(wave)
    mask = loud_frames(magnitude[None])[0, 0]
    assert mask[:-50].all() and not mask[-45:].any()
    marked = net.encoder(magnitude[None])[0]
    assert torch.equal(marked[:, -45:], magnitude[:, -45:])
    assert not torch.equal(marked[:, :10], magnitude[:, :10])


def test_shipped_geometry():
    released = json.loads((FIXTURES / "released_keys.json").read_text())
    hp = released["hparams"]
    config = PerthConfig()
    assert (config.sample_rate, config.n_fft, config.hop, config.hidden, config.max_wmark_freq,
            config.magnitude_floor) == (hp["sample_rate"], hp["n_fft"], hp["hop_size"], hp["hidden_size"],
                                        hp["max_wmark_freq"], hp["stft_magnitude_min"])
    assert hp["window_size"] == hp["n_fft"] and hp["window_fn"] == "hann"
    assert config.subband == 128


def test_shipped_names_and_shapes():
    """The shipped checkpoint's tensors fill ``PerthNet()`` exactly (its ``ap.`` STFT windows
    skipped), on the meta device."""
    released = json.loads((FIXTURES / "released_keys.json").read_text())["tensors"]
    with torch.device("meta"):
        net = PerthNet()
        load_perth(net, ((name, torch.empty(shape)) for name, shape in released.items()))
    assert sum(1 for name in released if name.startswith("ap.")) == 3


def test_loading_is_strict_both_ways():
    state = dict(TINY["state"])
    state.pop("decoder.fast_layers.6.conv.bias")
    with pytest.raises(WeightLoadError, match="fast_layers.6.conv.bias"):
        load_perth(PerthNet(PerthConfig(n_fft=256, hop=40, hidden=8)), state.items())


def test_analysis_round_trip_is_near_identity():
    """Without the mark, synthesis undoes analysis (but the edge, cut to whole hops)."""
    net = tiny_net()
    wave = TINY[32000]["clip"]
    again = net.synthesise(*net.analyse(wave))
    assert again.shape[-1] == (math.floor(wave.shape[-1] / 40)) * 40
    assert peak_err(again, wave[: again.shape[-1]]) < 1e-5
