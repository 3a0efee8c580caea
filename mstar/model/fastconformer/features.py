"""The FastConformer models' log-mel front end (what ``ParakeetFeatureExtractor`` and
``NemotronAsrStreamingFeatureExtractor`` compute), one clip at a time.

16 kHz mono audio gets a pre-emphasis filter (``x[t] - 0.97 x[t-1]``), a centred STFT
(512-point FFT of a 400-sample symmetric Hann window, hop 160, zero padding at both ends), its
power projected on a Slaney mel filterbank, then ``log(x + 2^-24)``. A clip of ``N`` samples
keeps ``N // 160`` frames. Parakeet then normalises each mel bin over the clip's frames (zero
mean, unit sample standard deviation); Nemotron ASR does not, and rounds its window and filters
to bfloat16 as its checkpoint stores them (``filter_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.audio.mel import mel_filterbank

LOG_GUARD = 2.0 ** -24
NORM_EPS = 1e-5


@dataclass(frozen=True)
class MelSettings:
    """A checkpoint's front end (its ``preprocessor_config.json``)."""

    n_mels: int = 128
    sample_rate: int = 16000
    n_fft: int = 512
    hop_length: int = 160
    win_length: int = 400
    preemphasis: float | None = 0.97
    normalize: bool = True  # per-bin mean and variance over the clip (Parakeet)
    filter_dtype: str = "float32"  # the precision the checkpoint keeps its window and filters in

    @classmethod
    def from_preprocessor(cls, d: dict[str, Any], *, normalize: bool) -> MelSettings:
        fields = {"feature_size": "n_mels", "sampling_rate": "sample_rate", "n_fft": "n_fft",
                  "hop_length": "hop_length", "win_length": "win_length", "preemphasis": "preemphasis",
                  "mel_filters_dtype": "filter_dtype"}
        d = d.get("feature_extractor", d)  # a processor_config.json nests it
        kwargs = {ours: d[theirs] for theirs, ours in fields.items() if theirs in d}
        return cls(normalize=normalize, **kwargs)

    def frames(self, num_samples: int) -> int:
        """Mel frames of a clip of ``num_samples`` samples."""
        return (num_samples + self.n_fft // 2 * 2 - self.n_fft) // self.hop_length


def _rounded(t: torch.Tensor, dtype_name: str) -> torch.Tensor:
    return t.to(getattr(torch, dtype_name)).to(torch.float32)


def log_mel(samples: torch.Tensor | np.ndarray, settings: MelSettings) -> torch.Tensor:
    """Log-mel features ``[frames, n_mels]`` (float32) of one mono clip at ``sample_rate``."""
    wave = torch.as_tensor(samples).to(torch.float32)
    if wave.dim() != 1:
        raise ValueError(f"expected mono audio of shape [num_samples], got {tuple(wave.shape)}")
    frames = settings.frames(wave.shape[0])
    if frames < 1:
        raise ValueError(f"a clip of {wave.shape[0]} samples is too short for one mel frame")
    if settings.preemphasis:
        wave = torch.cat([wave[:1], wave[1:] - settings.preemphasis * wave[:-1]])
    window = _rounded(torch.hann_window(settings.win_length, periodic=False, device=wave.device),
                      settings.filter_dtype)
    stft = torch.stft(wave, settings.n_fft, hop_length=settings.hop_length, win_length=settings.win_length,
                      window=window, center=True, pad_mode="constant", return_complex=True)
    power = torch.view_as_real(stft).pow(2).sum(-1)  # [n_fft // 2 + 1, stft frames]
    filters = mel_filterbank(settings.n_mels, settings.n_fft, settings.sample_rate, settings.sample_rate / 2)
    filters = _rounded(filters.to(torch.float32), settings.filter_dtype).to(wave.device)
    mel = torch.log(filters @ power + LOG_GUARD).T[:frames]  # [frames, n_mels]
    if settings.normalize:
        mean = mel.mean(dim=0, keepdim=True)
        var = (mel - mean).pow(2).sum(dim=0, keepdim=True) / max(frames - 1, 1)
        mel = (mel - mean) / (var.sqrt() + NORM_EPS)
    return mel.contiguous()
