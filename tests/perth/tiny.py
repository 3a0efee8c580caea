"""The tiny PerTh network the fixtures of ``record_reference.py`` were recorded with, as ours."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.model.perth import PerthConfig, PerthNet, load_perth

FIXTURES = Path(__file__).parent / "fixtures"
TINY = torch.load(FIXTURES / "tiny.pt")


def tiny_net() -> PerthNet:
    """Ours, loaded strictly from the reference's own state dict."""
    hp = TINY["config"]
    assert hp["window_size"] == hp["n_fft"] and hp["window_fn"] == "hann"
    config = PerthConfig(sample_rate=hp["sample_rate"], n_fft=hp["n_fft"], hop=hp["hop_size"], hidden=hp["hidden_size"],
                         max_wmark_freq=hp["max_wmark_freq"], magnitude_floor=hp["stft_magnitude_min"])
    net = PerthNet(config).eval()
    load_perth(net, TINY["state"].items())
    return net
