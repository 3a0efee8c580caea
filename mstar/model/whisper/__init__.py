"""Whisper speech recognition: config, log-mel front end and a paged-KV encoder-decoder."""

from mstar.model.whisper.config import WhisperConfig
from mstar.model.whisper.features import log_mel_spectrogram, mel_filterbank, mel_frames
from mstar.model.whisper.modeling import CrossKV, WhisperForConditionalGeneration

__all__ = [
    "CrossKV",
    "WhisperConfig",
    "WhisperForConditionalGeneration",
    "log_mel_spectrogram",
    "mel_filterbank",
    "mel_frames",
]
