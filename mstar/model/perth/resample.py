"""The two resamplers the PerTh reference wraps its 32 kHz network in, as ``librosa.resample``
runs them: soxr "HQ" (librosa's default) to mark a clip, scipy's polyphase filter to detect
one. Both then cut or zero-pad the result to ``ceil(samples * to_rate / from_rate)`` and keep
the input's dtype. soxr is not a dependency of M*: ``soxr_resample`` says how to get it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mstar.audio.io import resample

__all__ = ["polyphase_resample", "soxr_resample"]


def _fit(out: np.ndarray, samples: int, like: torch.Tensor) -> torch.Tensor:
    """``out`` cut or zero-padded to ``samples``, as a tensor of ``like``'s dtype and device."""
    fitted = np.zeros(samples, dtype=out.dtype)
    fitted[: min(samples, out.shape[0])] = out[:samples]
    return torch.from_numpy(fitted).to(device=like.device, dtype=like.dtype)


def _target_length(wave: torch.Tensor, from_rate: int, to_rate: int) -> int:
    return int(math.ceil(wave.shape[-1] * (float(to_rate) / from_rate)))


def soxr_resample(wave: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """One clip ``[samples]`` through soxr at "HQ" quality (needs ``pip install soxr``)."""
    try:
        import soxr
    except ImportError as err:
        raise ImportError("PerTh marks clips at rates other than 32 kHz through soxr: pip install soxr") from err
    out = soxr.resample(wave.detach().cpu().numpy(), from_rate, to_rate, quality="soxr_hq")
    return _fit(out, _target_length(wave, from_rate, to_rate), wave)


def polyphase_resample(wave: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """One clip ``[samples]`` through the project's polyphase resampler (``scipy.signal.resample_poly``
    at the reduced ratio, as the reference's detector runs it)."""
    out = resample(wave.detach().cpu().numpy(), from_rate, to_rate)
    return _fit(out, _target_length(wave, from_rate, to_rate), wave)
