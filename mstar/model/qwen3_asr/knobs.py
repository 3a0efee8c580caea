"""Qwen3-ASR's deployment knobs and request options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.knobs import CudaGraphs, FusedKernels, OverlapScheduling, RequestKnobs


class Qwen3ASRKnobs(CudaGraphs, FusedKernels, OverlapScheduling):
    """Qwen3-ASR's ``model_kwargs``; eager torch and the paged reference attention are the
    default and the reference. ``fused_kernels`` (CUDA) runs the LLM's norms, SiLU * up and
    RoPE as the Llama decoder's Triton kernels; ``cuda_graphs`` (CUDA) replays its decode steps
    from graphs, with the Triton attention kernels whatever ``attention_backend`` says;
    ``overlap_scheduling`` launches decode step k+1 before step k's bookkeeping."""

    attention_backend: Literal["torch", "triton"] = "torch"
    """The LLM's paged-attention kernels: ``torch`` (the reference) or ``triton``."""

    max_audio_seconds: float = Field(1200.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds of audio (20 minutes: the reference SDK's longest single
    pass). The whole clip is one prompt: ``max_seq_len`` must hold its audio positions (13 a
    second) and the transcript."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    max_new_tokens: int = Field(4096, ge=1)
    """Tokens a request may decode (fewer when the prompt leaves less of ``max_seq_len``)."""

    repetition_threshold: int = Field(20, ge=2)
    """A character repeated more than this many times in a row, or a pattern of up to 20
    characters repeated this many times, is collapsed to one copy (the reference SDK's 20)."""


class Qwen3ASRRequestKnobs(RequestKnobs):
    """The options of a Qwen3-ASR request (``/generate``'s ``model_kwargs``, and the
    ``model_kwargs`` form field of the OpenAI routes)."""

    language: str | None = None
    """The speech's language (a code such as ``en`` or a name such as ``English``); left out,
    the model detects it."""

    context: str | None = Field(None, max_length=4000)
    """Text for the system turn (names, terms) that biases the transcript; the OpenAI
    ``prompt`` is used when this is left out."""
