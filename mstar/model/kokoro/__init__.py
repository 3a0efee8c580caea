"""Kokoro-82M (hexgrad): G2P'd phonemes + a voice -> 24 kHz speech, with PL-BERT prosody and
an iSTFTNet decoder."""

from mstar.model.kokoro.config import KokoroConfig, PLBertConfig
from mstar.model.kokoro.modeling import KokoroModel

__all__ = ["KokoroConfig", "KokoroModel", "PLBertConfig"]
