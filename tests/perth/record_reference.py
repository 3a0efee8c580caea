"""Record ``tests/perth/fixtures/``: ``resemble-perth==1.0.1``'s ``PerthImplicitWatermarker``
on a tiny random network, for ``test_perth_parity.py`` (a script, not collected by pytest).

The package imports torchaudio for its STFT modules, and torchaudio has no build for torch
2.13; its 2.11.1 wheel's Python transforms work on torch 2.13 once its compiled extension is
moved aside (torchaudio then runs without it). Recorded in a private venv that sees the
project's torch 2.13.0::

    python3 -m venv /tmp/perthvenv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/perthvenv/lib/python3.11/site-packages/zz_project.pth
    /tmp/perthvenv/bin/pip install --no-deps torchaudio==2.11.1 resemble-perth==1.0.1
    /tmp/perthvenv/bin/pip install librosa            # librosa 0.11.0, soxr 1.1.0
    mkdir /tmp/perthvenv/disabled_so
    mv /tmp/perthvenv/lib/python3.11/site-packages/torchaudio/lib/*.so /tmp/perthvenv/disabled_so/
    /tmp/perthvenv/bin/python tests/perth/record_reference.py

``tiny.pt``: the network's state dict (its ``ap.`` windows included, as the shipped checkpoint
has them), two clips (32 kHz, and 24 kHz as S3Gen makes them, each with a quiet stretch) and
the reference's ``apply_watermark`` and ``get_watermark(..., round=False)`` of each, marked and
clean. ``released_keys.json``: the names and shapes of the shipped checkpoint's ``model``
(``perth_net/pretrained/implicit/perth_net_250000.pth.tar``), and its ``hparams.yaml``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).parent / "fixtures"
TINY = dict(use_wandb=False, batch_size=1, sample_rate=32000, n_fft=256, hop_size=40, window_size=256,
            use_lr_scheduler=False, stft_magnitude_min=1e-9, min_lr=1e-5, max_lr=1e-4, window_fn="hann",
            max_wmark_freq=2000, hidden_size=8, loss_type="psychoacoustic")


def clip(samples: int, seed: int) -> np.ndarray:
    """Noise under a slow envelope, its last fifth quiet (-80 dB)."""
    g = np.random.RandomState(seed)
    envelope = 0.3 * (1.2 + np.sin(np.linspace(0, 7, samples)))
    envelope[-samples // 5:] = 1e-4
    return (envelope * g.randn(samples)).astype(np.float32)


def record_tiny() -> dict:
    from perth.perth_net.perth_net_implicit.config import PerthConfig
    from perth.perth_net.perth_net_implicit.model.perth_net import PerthNet
    from perth.perth_net.perth_net_implicit.perth_watermarker import PerthImplicitWatermarker

    torch.manual_seed(0)
    net = PerthNet(PerthConfig(**TINY)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        net.encoder.layers[-1].conv.weight.mul_(0.01)  # a mark of a few dB, not a rewrite
        net.encoder.layers[-1].conv.bias.mul_(0.01)
        for stack in (net.decoder.slow_layers, net.decoder.normal_layers, net.decoder.fast_layers):
            stack[-1].conv.bias[1] += 0.5  # scores inside (0, 1), where the clip does not hide them
    marker = PerthImplicitWatermarker(run_name=None, perth_net=net)
    out = dict(config=TINY, state={k: v.clone() for k, v in net.state_dict().items()})
    for rate, samples, seed in ((32000, 8000, 2), (24000, 6000, 3)):
        wave = clip(samples, seed)
        with torch.no_grad():
            marked = marker.apply_watermark(wave, sample_rate=rate)
            out[rate] = dict(clip=torch.from_numpy(wave), marked=torch.from_numpy(marked),
                             score_marked=float(marker.get_watermark(marked, rate, round=False)),
                             score_clean=float(marker.get_watermark(wave, rate, round=False)))
    return out


def released_keys() -> dict:
    import perth
    import yaml

    directory = Path(perth.__file__).parent / "perth_net" / "pretrained" / "implicit"
    state = torch.load(directory / "perth_net_250000.pth.tar", map_location="cpu")["model"]
    return dict(tensors={k: list(v.shape) for k, v in state.items()},
                hparams=yaml.safe_load((directory / "hparams.yaml").read_text()))


if __name__ == "__main__":
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "tiny.pt"
    torch.save(record_tiny(), path)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    keys = FIXTURES / "released_keys.json"
    keys.write_text(json.dumps(released_keys(), indent=0) + "\n")
    print(f"wrote {keys} ({keys.stat().st_size} bytes)")
