"""Piper's deployment knobs and a speech request's options."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Knobs, RequestKnobs

__all__ = ["PiperGenerateKnobs", "PiperKnobs", "PiperSpeechKnobs"]


class PiperKnobs(Knobs):
    noise_scale: float | None = Field(None, ge=0.0, le=2.0)
    """The prior's noise scale for every request (unset: the voice JSON's ``inference.noise_scale``)."""

    noise_w: float | None = Field(None, ge=0.0, le=2.0)
    """The duration predictor's noise scale (unset: the voice JSON's ``inference.noise_w``)."""

    max_sentences: int = Field(64, ge=1, le=1024)
    """Sentences one request may hold (each is one synthesis and one audio chunk)."""


class PiperSpeechKnobs(RequestKnobs):
    """A Piper speech request's ``model_kwargs``."""

    phonemes: str | None = Field(None, min_length=1, max_length=8192)
    """Speak these espeak phonemes (one sentence) instead of the text's."""

    phoneme_ids: list[int] | None = Field(None, min_length=1, max_length=8192)
    """Speak these ids as they are (already framed with BOS/padding/EOS)."""

    noise_scale: float | None = Field(None, ge=0.0, le=2.0)
    noise_w: float | None = Field(None, ge=0.0, le=2.0)

    seed: int | None = Field(None, ge=0)
    """Seed of this request's noise (default 0): the same seed gives the same audio."""


class PiperGenerateKnobs(PiperSpeechKnobs):
    """``/generate``'s ``model_kwargs`` for Piper: a speech request's, plus ``voice`` and ``speed``."""

    voice: str | None = None
    speed: float = Field(1.0, ge=0.25, le=4.0)
