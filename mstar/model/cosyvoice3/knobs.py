"""CosyVoice3's deployment knobs and a speech request's options (``model_kwargs``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.knobs import DecodeKnobs, RequestKnobs
from mstar.model.voice_cloning import ConditioningCacheKnobs

__all__ = ["CosyVoice3GenerateKnobs", "CosyVoice3Knobs", "CosyVoice3SpeechKnobs"]


class CosyVoice3Knobs(ConditioningCacheKnobs, DecodeKnobs):
    voices_dir: str | None = None
    """Preset voices: ``<name>.wav`` with its transcript in ``<name>.txt``, cloned like an
    uploaded clip. Every request clones, so without it each request must send ``ref_audio``."""

    flow_estimator_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The DiT's precision on a GPU (the Euler state, the rest of the flow and HiFT stay
    float32); float32 is the reference's, slower. On the CPU the DiT always runs float32."""

    sentence_chunking: bool = True
    """Speak long text as ordered sentence pieces (a request's ``sentence_chunking`` overrides):
    the LM ends long text early or garbles its end."""

    dummy_scale: Literal["real", "tiny"] = "real"
    """Under ``load_format: dummy``: the released shapes, or tiny ones (tests, CI)."""


class CosyVoice3SpeechKnobs(RequestKnobs):
    """A speech request's ``model_kwargs``."""

    seed: int | None = Field(None, ge=0)
    """Seeds the LM's repetition-aware sampling (unset: fresh randomness). The flow's noise is
    the reference's fixed table, so a seed fixes the whole output."""

    instructions: str | None = None
    """A style instruction (\"Speak slowly and calmly.\"), put before ``<|endofprompt|>``."""

    max_tokens: int | None = Field(None, ge=1)
    """Speech tokens (25 a second) at most; default: the text's length times 20."""


class CosyVoice3GenerateKnobs(CosyVoice3SpeechKnobs):
    """``/generate``'s ``model_kwargs``: a speech request's plus ``voice`` and ``sentence_chunking``."""

    voice: str | None = None
    sentence_chunking: bool | None = None
