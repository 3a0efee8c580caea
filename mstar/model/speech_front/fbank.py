"""Kaldi-style log mel filterbank features, as ``torchaudio.compliance.kaldi.fbank`` computes
them with its defaults (the front end of the CAMPPlus speaker encoder). torchaudio does not
install beside our torch, so this is our own; ``tests/speech_front`` pins it to torchaudio.

Per 25 ms frame (400 samples at 16 kHz), every 10 ms (160), only frames that fit whole
(Kaldi's ``snip_edges``): subtract the frame's mean, pre-emphasise (``x[n] - 0.97 x[n-1]``,
the first sample against itself), multiply by the Povey window (a symmetric Hann raised to
0.85), zero-pad to 512, take the power spectrum, project on triangular filters that are
equally spaced on Kaldi's mel scale ``1127 ln(1 + f / 700)`` between 20 Hz and Nyquist
(the Nyquist bin carries no weight), and take ``ln``, floored at float32's epsilon. No
dither (torchaudio's default), no energy column.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
FRAME_LENGTH = 400  # 25 ms
FRAME_SHIFT = 160  # 10 ms
PADDED_LENGTH = 512  # the frame rounded up to a power of two
PREEMPHASIS = 0.97
LOW_HZ = 20.0


def _kaldi_mel(hz: float) -> float:
    return 1127.0 * math.log(1.0 + hz / 700.0)


@lru_cache(maxsize=8)
def kaldi_mel_banks(num_bins: int, padded_length: int = PADDED_LENGTH, sample_rate: int = SAMPLE_RATE,
                    low_hz: float = LOW_HZ) -> torch.Tensor:
    """Triangular filters ``[num_bins, padded_length // 2 + 1]`` (float32, CPU, cached: do not
    modify in place), each rising from its left edge to its centre and falling to its right
    edge in mel; the last (Nyquist) column is zero as in Kaldi.

    Computed in float32 as torchaudio does: the low bins are narrow and pre-emphasis leaves
    little energy there, so float64 filters move their log energies by up to 2e-4.
    """
    low_mel = _kaldi_mel(low_hz)
    step = (_kaldi_mel(sample_rate / 2) - low_mel) / (num_bins + 1)
    index = torch.arange(num_bins, dtype=torch.float32)[:, None]
    left, center, right = low_mel + index * step, low_mel + (index + 1.0) * step, low_mel + (index + 2.0) * step
    bin_hz = torch.arange(padded_length // 2, dtype=torch.float32) * (sample_rate / padded_length)
    bin_mel = 1127.0 * (1.0 + bin_hz / 700.0).log()
    rising = (bin_mel - left) / (center - left)
    falling = (right - bin_mel) / (right - center)
    banks = torch.minimum(rising, falling).clamp(min=0.0)
    return F.pad(banks, (0, 1))


@lru_cache(maxsize=8)
def _povey_window(length: int) -> torch.Tensor:
    return torch.hann_window(length, periodic=False, dtype=torch.float32).pow(0.85)


def kaldi_fbank(wave: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """Log filterbank energies ``[frames, num_bins]`` (float32) of one 16 kHz clip ``[len]``
    with samples in [-1, 1]; ``frames = 1 + (len - 400) // 160`` (none under 25 ms)."""
    if wave.dim() != 1:
        raise ValueError(f"expected one mono clip [num_samples], got {tuple(wave.shape)}")
    wave = wave.to(torch.float32)
    if wave.shape[0] < FRAME_LENGTH:
        return wave.new_zeros(0, num_bins)
    frames = wave.unfold(0, FRAME_LENGTH, FRAME_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat((frames[:, :1], frames[:, :-1]), dim=1)
    frames = (frames - PREEMPHASIS * previous) * _povey_window(FRAME_LENGTH).to(wave.device)
    spectrum = torch.fft.rfft(F.pad(frames, (0, PADDED_LENGTH - FRAME_LENGTH))).abs().pow(2.0)
    energies = spectrum @ kaldi_mel_banks(num_bins).to(wave.device).T
    return energies.clamp(min=torch.finfo(torch.float32).eps).log()
