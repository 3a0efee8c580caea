"""Kokoro's deployment knobs and a speech request's options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mstar.model.knobs import FusedKernels, Knobs, RequestKnobs

__all__ = ["KokoroGenerateKnobs", "KokoroKnobs", "KokoroSpeechKnobs"]

LangCode = Literal["a", "b", "e", "f", "h", "i", "p", "j", "z"]
"""Kokoro's languages (``mstar.model.kokoro.phonemes.LANGUAGES``)."""


class KokoroKnobs(FusedKernels, Knobs):
    """``fused_kernels``: the vocoder's AdaIN + Snake/leaky ReLU + padding mask as Triton
    kernels (``mstar.layers.triton_adain``), three passes over each activation instead of ~30."""

    interpreted_on_cpu = True  # its kernel tests run them on the CPU under the interpreter

    lang_code: LangCode | None = None
    """Fix the G2P language for every request (``a`` American, ``b`` British English, ``e``
    Spanish, ``f`` French, ``h`` Hindi, ``i`` Italian, ``p`` Brazilian Portuguese, ``j``
    Japanese, ``z`` Mandarin); unset, a request's ``lang_code`` or its voice's first letter
    decides."""

    espeak_fallback: bool = False
    """Let misaki spell out-of-dictionary English words with espeak-ng (when installed)."""

    chunk_target_phonemes: int = Field(400, ge=16, le=510)
    """Phonemes a chunk is packed up to (whole sentences; one synthesis and one audio chunk each)."""

    first_chunk_target_phonemes: int = Field(100, ge=16, le=510)
    """The first chunk's target: short, so that the first audio comes after one short synthesis."""

    dummy_config: dict[str, Any] = Field(default_factory=dict)
    """Under ``load_format: dummy``: ``config.json`` keys over Kokoro-82M's (a smaller model for
    tests); ignored with real weights, whose ``config.json`` decides."""

    @field_validator("dummy_config")
    @classmethod
    def _is_a_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        from mstar.model.kokoro.checkpoint import dummy_config

        dummy_config(value)  # ValueError naming the key
        return value


class KokoroSpeechKnobs(RequestKnobs):
    """A Kokoro speech request's ``model_kwargs``."""

    phonemes: str | None = Field(None, min_length=1, max_length=8192)
    """Speak these phonemes (Kokoro's alphabet) instead of the text's G2P."""

    lang_code: LangCode | None = None
    """The G2P language of the text (as the deployment knob); unset, the voice's first letter."""

    seed: int | None = Field(None, ge=0)
    """Seed of the harmonic source's noise (default: a fixed seed per request, 0)."""


class KokoroGenerateKnobs(KokoroSpeechKnobs):
    """``/generate``'s ``model_kwargs`` for Kokoro: a speech request's, plus ``voice``, ``speed`` and
    ``sentence_chunking``."""

    voice: str | None = None
    speed: float = Field(1.0, ge=0.25, le=4.0)
    sentence_chunking: bool | None = None
    """False: chunks as long as the window allows, not a short first one (as on /v1/audio/speech)."""
