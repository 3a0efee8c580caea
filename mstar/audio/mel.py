"""Slaney-normalised mel filterbanks, shared by the speech front ends (Whisper's log-mel,
the FastConformer families' log-mel).

Slaney's mel scale is linear (3 mels per 200 Hz) up to 1 kHz and logarithmic above it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

_LINEAR_MEL_PER_HZ = 3.0 / 200.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ * _LINEAR_MEL_PER_HZ  # 15
_MEL_PER_LOG_HZ = 27.0 / math.log(6.4)


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    octaves = torch.log(hz.clamp(min=_LOG_START_HZ) / _LOG_START_HZ)
    log_part = _LOG_START_MEL + octaves * _MEL_PER_LOG_HZ
    return torch.where(hz >= _LOG_START_HZ, log_part, hz * _LINEAR_MEL_PER_HZ)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    octaves = (mel.clamp(min=_LOG_START_MEL) - _LOG_START_MEL) / _MEL_PER_LOG_HZ
    log_part = _LOG_START_HZ * torch.exp(octaves)
    return torch.where(mel >= _LOG_START_MEL, log_part, mel / _LINEAR_MEL_PER_HZ)


@lru_cache(maxsize=16)
def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int, max_frequency: float) -> torch.Tensor:
    """Slaney-normalised triangular mel filters ``[n_mels, n_fft // 2 + 1]`` (float64, CPU;
    cached and shared, so do not modify it in place).

    Filter ``m`` rises linearly from edge ``m`` to ``m + 1`` and falls to ``m + 2``, the
    ``n_mels + 2`` edges being equally spaced in mel between 0 Hz and ``max_frequency``; each is
    scaled by ``2 / (its width in Hz)`` so that every band carries about the same energy.
    """
    fft_hz = torch.linspace(0.0, float(sample_rate // 2), n_fft // 2 + 1, dtype=torch.float64)
    top_mel = _hz_to_mel(torch.tensor(max_frequency, dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(0.0, float(top_mel), n_mels + 2, dtype=torch.float64))
    left, center, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_hz[None, :] - left) / (center - left)
    falling = (right - fft_hz[None, :]) / (right - center)
    triangles = torch.minimum(rising, falling).clamp(min=0.0)
    return triangles * (2.0 / (right - left))
