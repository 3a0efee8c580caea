"""Higgs Audio v3 STT's deployment knobs and request options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.knobs import FusedKernels, RequestKnobs

# The instruction public code gives for the release's transcription prompt.
DEFAULT_INSTRUCTION = "Transcribe the speech. Output only the spoken words in lowercase with no punctuation."


class HiggsAudioKnobs(FusedKernels):
    """Higgs Audio's ``model_kwargs`` (Beta: eager torch and the paged reference attention are
    the default and the reference). ``fused_kernels`` (CUDA) runs the LLM's norms, SiLU * up
    and RoPE as the Llama decoder's Triton kernels."""

    attention_backend: Literal["torch", "triton"] = "torch"
    """The LLM's paged-attention kernels: ``torch`` (the reference) or ``triton``."""

    max_audio_seconds: float = Field(1200.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds of audio (20 minutes); longer than ``max_clip_seconds``,
    it is cut into windows at quiet points, each decoded as its own request."""

    max_clip_seconds: float = Field(30.0, gt=0, allow_inf_nan=False)
    """The longest window one request decodes, in seconds (375 audio positions at 30 s)."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    max_new_tokens: int = Field(512, ge=1)
    """Tokens a window may decode (fewer when the prompt leaves less of ``max_seq_len``)."""


class HiggsAudioRequestKnobs(RequestKnobs):
    """The options of a Higgs Audio request (``/generate``'s ``model_kwargs``, and the
    ``model_kwargs`` form field of the OpenAI routes)."""

    instruction: str | None = Field(None, min_length=1, max_length=2000)
    """The user turn's text before the audio, in place of the default (``Transcribe the
    speech. Output only the spoken words in lowercase with no punctuation.``)."""
