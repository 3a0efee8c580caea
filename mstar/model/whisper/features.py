"""Whisper's log-mel spectrogram front end (what ``WhisperFeatureExtractor`` computes).

16 kHz mono audio is zero-padded or trimmed to ``n_samples`` (30 s), framed by a centred STFT
(400-point Hann window, hop 160, reflect padding at both ends), turned into power, projected on
a Slaney mel filterbank, then ``log10`` (floored at 1e-10), limited to 8 decades below its
maximum and mapped by ``(x + 4) / 4``. The last STFT frame is dropped, so 30 s give 3000 frames.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.audio.mel import mel_filterbank as slaney_filterbank

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SAMPLES = 30 * SAMPLE_RATE  # 480000
MAX_FREQUENCY = 8000.0


def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                   max_frequency: float = MAX_FREQUENCY) -> torch.Tensor:
    """Whisper's Slaney mel filters ``[n_mels, n_fft // 2 + 1]`` (float64, CPU, cached: do not
    modify it in place); ``mstar.audio.mel`` computes them."""
    return slaney_filterbank(n_mels, n_fft, sample_rate, max_frequency)


def mel_frames(num_samples: int, n_samples: int = CHUNK_SAMPLES) -> int:
    """How many of the ``n_samples // 160`` mel frames hold real audio for a clip of
    ``num_samples`` samples (as ``WhisperFeatureExtractor``'s attention mask counts them)."""
    return -(-min(max(num_samples, 0), n_samples) // HOP_LENGTH)


def log_mel_spectrogram(
    audio: torch.Tensor | np.ndarray,
    n_mels: int = 80,
    n_samples: int = CHUNK_SAMPLES,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Whisper input features ``[n_mels, n_samples // 160]`` (float32) of one 16 kHz mono clip.

    The audio is first rounded to float32 (as the Hugging Face extractor does), then computed in
    ``compute_dtype`` on the audio's device: float32 reproduces the extractor's default torch
    path, float64 its numpy path (the two differ by up to ~2e-5 on pure tones).
    """
    wave = torch.as_tensor(audio)
    if wave.dim() != 1:
        raise ValueError(f"expected mono audio of shape [num_samples], got {tuple(wave.shape)}")
    wave = wave.to(torch.float32)[:n_samples]
    wave = torch.nn.functional.pad(wave, (0, n_samples - wave.shape[0])).to(compute_dtype)

    window = torch.hann_window(N_FFT, periodic=True, dtype=compute_dtype, device=wave.device)
    # Centred frames, reflect-padded at both ends (torch.stft's defaults).
    stft = torch.stft(wave, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = (stft[:, :-1].abs() ** 2).contiguous()  # [n_fft // 2 + 1, frames]

    filters = mel_filterbank(n_mels).to(device=wave.device, dtype=compute_dtype)
    log_spec = (filters @ power).clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).to(torch.float32)
