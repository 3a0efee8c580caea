"""The prompt clip's mel front of S3Gen (Matcha-TTS's ``mel_spectrogram`` with CosyVoice's
24 kHz settings): a 24 kHz waveform -> 80-bin log-magnitude mel frames at 50 per second, the
``prompt_mel`` the flow decoder is conditioned on.

- the clip is reflection-padded by ``(n_fft - hop) / 2`` samples on each side and cut into
  ``n_fft``-sample Hann-windowed frames every ``hop`` samples (no further centring), so a clip
  of ``n`` samples gives ``n // hop`` frames when ``n`` is a whole number of hops;
- the magnitude is ``sqrt(re^2 + im^2 + 1e-9)`` (the small term keeps the gradient finite in
  training and shifts silent bins off zero);
- an 80 x 961 Slaney mel filterbank (0 to 8 kHz) sums the bins; the result is
  ``log(max(x, 1e-5))``.

The filterbank is librosa's ``filters.mel`` with its defaults (Slaney's mel scale: linear to
1 kHz, logarithmic above; each triangle scaled to unit area, ``norm='slaney'``). It is
computed here in float64 and rounded to float32 at the same two points as librosa, so it
matches librosa's table to the float32 rounding without librosa being a dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = ["MelConfig", "hz_to_mel", "log_mel", "mel_filterbank", "mel_to_hz"]

_LINEAR_HZ_PER_MEL = 200.0 / 3  # Slaney: 3 mels per 200 Hz below 1 kHz
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0  # 27 mels per factor 6.4 above 1 kHz


@dataclass(frozen=True)
class MelConfig:
    """S3Gen's settings (CosyVoice2's ``feat_extractor`` for 24 kHz)."""

    sampling_rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale (librosa's default, ``htk=False``)."""
    log_part = _LOG_START_MEL + torch.log(hz.clamp(min=_LOG_START_HZ) / _LOG_START_HZ) / _LOG_STEP
    return torch.where(hz >= _LOG_START_HZ, log_part, hz / _LINEAR_HZ_PER_MEL)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    """The inverse of ``hz_to_mel``."""
    log_part = _LOG_START_HZ * torch.exp(_LOG_STEP * (mel - _LOG_START_MEL))
    return torch.where(mel >= _LOG_START_MEL, log_part, mel * _LINEAR_HZ_PER_MEL)


@lru_cache(maxsize=8)
def mel_filterbank(config: MelConfig = MelConfig()) -> torch.Tensor:
    """The ``[n_mels, n_fft // 2 + 1]`` float32 filterbank: triangles between consecutive
    points of ``n_mels + 2`` mel-spaced frequencies from ``fmin`` to ``fmax``, each divided by
    half its width in Hz (unit area). Treat the cached tensor as read-only."""
    c = config
    # the bin frequencies and the mel points in numpy's rfftfreq and linspace arithmetic
    bins = torch.arange(c.n_fft // 2 + 1, dtype=torch.float64) * (1.0 / (c.n_fft * (1.0 / c.sampling_rate)))
    lo, hi = (hz_to_mel(torch.tensor(f, dtype=torch.float64)) for f in (c.fmin, c.fmax))
    points = torch.arange(c.n_mels + 2, dtype=torch.float64) * ((hi - lo) / (c.n_mels + 1)) + lo
    points[-1] = hi
    edges = mel_to_hz(points)
    widths = edges.diff()
    rising = (bins[None] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - bins[None]) / widths[1:, None]
    triangles = torch.minimum(rising, falling).clamp(min=0).float()  # librosa rounds here...
    area = 2.0 / (edges[2:] - edges[:-2])
    return (triangles.double() * area[:, None]).float()  # ...and after the area scaling


def log_mel(wave: torch.Tensor, config: MelConfig = MelConfig()) -> torch.Tensor:
    """Waveform ``[B, samples]`` (or ``[samples]``) at ``sampling_rate`` -> log-mel ``[B,
    n_mels, frames]`` with ``frames = samples // hop`` (the padding makes up the window's
    overhang); S3Gen wants two frames per prompt speech token, so a clip of ``k * 40`` ms."""
    c = config
    if wave.dim() == 1:
        wave = wave[None]
    side = (c.n_fft - c.hop) // 2
    padded = F.pad(wave[:, None], (side, side), mode="reflect")[:, 0]
    window = torch.hann_window(c.n_fft, device=wave.device, dtype=wave.dtype)
    spec = torch.stft(padded, c.n_fft, hop_length=c.hop, win_length=c.n_fft, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    bank = mel_filterbank(c).to(device=wave.device, dtype=wave.dtype)
    return torch.log(torch.clamp(bank @ magnitude, min=1e-5))
