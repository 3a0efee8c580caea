"""Orpheus's deployment knobs (the talker's decode switches, its budget, the SNAC codec) and
the options of a speech request."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from mstar.model.decoding import SamplingKnobs
from mstar.model.knobs import DecodeKnobs
from mstar.model.snac import SnacConfig


class OrpheusKnobs(DecodeKnobs):
    max_new_tokens: int = Field(1200, ge=1)
    """Audio tokens a request may speak when it does not send ``max_tokens``."""

    benchmark_audio_only: bool = False
    """Benchmarking only: every request speaks its whole budget as audio codes (sampling
    restricted to the valid code of each position, END_OF_SPEECH ignored), so that dummy
    weights make a fixed amount of audio. Never set it to serve users."""

    snac_path: str = "hubertsiuzdak/snac_24khz"
    """The SNAC codec: a Hugging Face id or a directory (``config.json``, ``pytorch_model.bin``)."""

    snac_config: dict[str, Any] = Field(default_factory=dict)
    """The codec's config under ``load_format: dummy`` (SNAC's ``config.json`` keys)."""

    @field_validator("snac_config")
    @classmethod
    def _is_a_snac_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            SnacConfig.from_dict(value)
        except TypeError as err:
            raise ValueError(str(err)) from None
        return value


class SpeechKnobs(SamplingKnobs):
    """A speech request's ``model_kwargs``: sampling and ``max_tokens``."""

    max_tokens: int | None = Field(None, ge=1)
    """Audio tokens at most (default: the deployment's ``max_new_tokens``)."""


class OrpheusGenerateKnobs(SpeechKnobs):
    """``/generate``'s ``model_kwargs`` for Orpheus: a speech request's, the ``voice`` and
    ``sentence_chunking``."""

    voice: str | None = None
    sentence_chunking: bool | None = None
    """True: long text is spoken as sentence pieces, one talker walk each (default: whole)."""
