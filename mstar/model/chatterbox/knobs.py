"""Chatterbox's deployment knobs and a speech request's options.

The three registry keys share these; ``variant`` defaults to the key's. Request options carry
the reference package's ``generate`` arguments with its demo's ranges, so a value the model was
never meant to see is a 400 naming the field rather than odd audio.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.knobs import Knobs, RequestKnobs
from mstar.model.voice_cloning import ConditioningCacheKnobs

__all__ = ["LANGUAGES", "ChatterboxGenerateKnobs", "ChatterboxKnobs", "ChatterboxSpeechKnobs", "Variant"]

Variant = Literal["english", "multilingual", "turbo"]
LANGUAGES = ("ar", "da", "de", "el", "en", "es", "fi", "fr", "he", "hi", "it", "ja", "ko", "ms", "nl", "no", "pl",
             "pt", "ru", "sv", "sw", "tr", "zh")
"""The multilingual model's language tokens (``[<id>]`` in front of the text)."""


class ChatterboxKnobs(ConditioningCacheKnobs, Knobs):
    variant: Variant | None = None
    """Which T3 the directory's weights are (unset: the registry key's)."""

    default_language: Literal[LANGUAGES] = "en"  # type: ignore[valid-type]
    """Multilingual only: the language of a request that sends no ``language_id``."""

    watermark: bool = True
    """Mark every output with PerTh (a request may turn it off with ``watermark: false``)."""

    perth_path: str | None = None
    """PerTh's weights (``perth_net_250000.pth.tar`` from the ``resemble-perth`` wheel); unset
    with real weights: outputs are not marked, and startup logs it. Ignored under dummy."""

    max_new_tokens_limit: int = Field(1000, ge=1)
    """Speech tokens (25 a second) a request may ask for at most; also its default budget."""

    voices_dir: str | None = None
    """Preset voices (``<name>.wav`` + optional ``<name>.txt``) cloned like an uploaded clip."""

    stream_chunk_tokens: int = Field(50, ge=0)
    """A ``stream: true`` request's second chunk of speech tokens (25 a second); later ones
    grow by ``stream_chunk_growth`` up to ``stream_max_chunk_tokens``. 0: streamed requests
    are synthesised as whole utterances too (the reference path, one chunk at the end)."""

    stream_first_chunk_tokens: int | None = Field(None, ge=1)
    """Speech tokens before the first audio chunk (unset: 35 on the English model, 15 on the
    multilingual and Turbo ones)."""

    stream_chunk_growth: float = Field(2.0, ge=1.0)
    """Each chunk after the second: the previous chunk's tokens times this, up to the maximum."""

    stream_max_chunk_tokens: int = Field(200, ge=1)

    stream_context_tokens: int = Field(25, ge=0)
    """Settled tokens a streamed chunk's flow solve keeps as left context before the audio
    already sent (a constant cost per chunk); 0: the whole history."""

    dummy_scale: Literal["real", "tiny"] = "real"
    """Under ``load_format: dummy``: the released shapes, or tiny ones (tests, CI)."""


class ChatterboxSpeechKnobs(RequestKnobs):
    """A speech request's ``model_kwargs`` (the reference's ``generate`` arguments)."""

    exaggeration: float = Field(0.5, ge=0.0, le=2.0)
    """Emotion intensity (T3's ``emotion_adv`` row; Turbo ignores it, as the reference does)."""

    cfg_weight: float = Field(0.5, ge=0.0, le=1.0)
    """Classifier-free guidance weight; 0 runs no unconditional row (Turbo has none)."""

    # sampling: unset, the variant's reference defaults (``model.SAMPLING_DEFAULTS``)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    """Turbo only (its filter order has top-k); the guided variants ignore it."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """The guided variants only; Turbo ignores it, as the reference does."""
    repetition_penalty: float | None = Field(None, ge=1.0, le=2.0)
    seed: int | None = Field(None, ge=0)
    """Seeds both T3's draws and S3Gen's noise (unset: fresh randomness)."""

    language_id: str | None = None
    """Multilingual: the text's language (default: the deployment's ``default_language``)."""

    max_new_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    """The route's generic name for ``max_new_tokens``."""

    watermark: bool | None = None
    """False: this output is not marked (default: the deployment's ``watermark``)."""


class ChatterboxGenerateKnobs(ChatterboxSpeechKnobs):
    """``/generate``'s ``model_kwargs``: a speech request's plus ``voice`` and
    ``sentence_chunking``."""

    voice: str | None = None
    sentence_chunking: bool | None = None
    """True: the text is spoken as groups of sentences (up to 400 characters), in order."""
