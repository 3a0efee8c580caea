"""Omnilingual ASR CTC's deployment knobs and request options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.config import ConfigError
from mstar.model.knobs import Knobs, RequestKnobs

MODEL_SECONDS = 40.0  # the longest clip the reference transcribes


class OmniAsrKnobs(Knobs):
    """``model_kwargs`` of the ``omnilingual_asr_ctc_*`` keys."""

    weights_version: Literal["v1"] = "v1"
    """The release to load: ``v1``, the ``facebook/omniASR-CTC-*`` Hub repos (a deployment's
    ``model_path`` or ``checkpoint_path`` takes a local copy instead)."""

    checkpoint_path: str | None = None
    """A local release ``.pt`` (fairseq2's state dict) or a transformers ``OmniASRForCTC``
    directory, in place of the Hub's."""

    tokenizer_path: str | None = None
    """A local SentencePiece ``.model`` or ``tokenizer.json`` (default: the one beside the weights)."""

    max_batch_size: int = Field(16, ge=1)
    """The most clips in one forward."""

    max_batch_seconds: float = Field(320.0, gt=0, allow_inf_nan=False)
    """A forward's padded audio (rows times its longest clip), in seconds: a step's clips,
    sorted by length, are split into forwards that stay within it (a longer clip runs alone)."""

    whole_seconds: float = Field(20.0, gt=0, le=MODEL_SECONDS, allow_inf_nan=False)
    """An upload up to this long is transcribed whole."""

    window_seconds: float = Field(16.0, gt=0, le=MODEL_SECONDS, allow_inf_nan=False)
    """The longest window a longer upload is cut into."""

    max_audio_seconds: float = Field(1200.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.window_seconds > self.whole_seconds:
            raise ConfigError("model_kwargs.window_seconds: must not exceed model_kwargs.whole_seconds")


class OmniAsrRequestKnobs(RequestKnobs):
    """A request's options (``model_kwargs`` of ``/v1/audio/transcriptions`` or ``/generate``)."""

    language: str | None = None
    """Accepted and ignored: the CTC head covers every language at once."""

    window_seconds: float | None = Field(None, gt=0, le=MODEL_SECONDS, allow_inf_nan=False)
    """This request's window length (both the whole-clip limit and the window), up to 40 s."""

    whole: bool = False
    """Transcribe the clip as one window, refusing one over 40 s (the model's limit) rather
    than cutting it; ``/generate`` sets it unless its ``model_kwargs`` say otherwise."""
