"""Whisper's deployment knobs: upload limits, the decode budget, and the fast paths of its
encoder and decoder (eager torch is the default and the reference)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from mstar.config import ConfigError
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from mstar.model.knobs import (
    CudaGraphs,
    FusedKernels,
    OverlapScheduling,
    RequestKnobs,
    require_cuda,
    triton_interpreted,
)


class WhisperKnobs(CudaGraphs, FusedKernels, OverlapScheduling):
    """``cuda_graphs`` replays decode steps per batch bucket (``cuda_graph_batch_sizes``) with
    the Triton attention kernels; ``fused_kernels`` runs decode steps with one q/k/v GEMM, the
    attention scale in the kernels and Triton residual add + LayerNorm, and steps of a few
    rows with every projection a Triton GEMV that folds in the norm, GELU and the KV write
    (``WhisperDecoderLayer.forward_gemv``)."""

    interpreted_on_cpu = True  # its kernels' tests run them on the CPU under the interpreter

    max_audio_seconds: float = Field(600.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds of audio."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    max_new_tokens: int | None = Field(None, ge=1)
    """Tokens a 30-second window may decode (default: half the decoder's context)."""

    attention_backend: Literal["torch", "triton"] = Field(
        default_factory=lambda knobs: "triton" if knobs["cuda_graphs"] else "torch")
    """The decoder's self- and cross-attention: ``torch`` (the reference) or ``triton``
    (default: ``triton`` with ``cuda_graphs``, else ``torch``)."""

    cuda_graph_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: list(DEFAULT_BATCH_SIZES), min_length=1)
    """The batch buckets ``cuda_graphs`` captures."""

    encoder_cuda_graphs: bool = Field(default_factory=lambda knobs: knobs["cuda_graphs"])
    """Replay the encoder per batch bucket (default: ``cuda_graphs``; CUDA only)."""

    quantization: Literal["none", "int8", "w8a8"] = "none"
    """``int8``: the decoder's per-token linear layers and the tied logits as weight-only int8
    (a scale per output row; CPU only), applied after loading (``mstar.model.whisper.quantize``
    says which layers and why). ``w8a8``: the same layers as int8 weights times activations
    rounded to int8 per token (CTranslate2's int8 mode). ``none``: float weights, the reference."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.attention_backend == "triton" and device != "cuda" and not triton_interpreted():
            raise ConfigError("model_kwargs.attention_backend: 'triton' needs device: cuda")
        if self.cuda_graphs and self.attention_backend != "triton":
            raise ConfigError("model_kwargs.cuda_graphs needs attention_backend 'triton' (the torch "
                              "reference synchronises with the host and cannot be captured)")
        if self.encoder_cuda_graphs:
            require_cuda("encoder_cuda_graphs", device)
        if self.quantization != "none":
            if device != "cpu":
                raise ConfigError(f"model_kwargs.quantization: {self.quantization} runs on the CPU only "
                                  "(PyTorch's int8 CPU kernel); use none on CUDA")
            if self.fused_kernels:
                raise ConfigError(f"model_kwargs.quantization: {self.quantization} cannot run with "
                                  "fused_kernels (its fused q/k/v product reads the float weights)")


class TranscribeKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for a speech recogniser (its one file is the audio)."""

    language: str | None = None
    """The speech's language (an ISO-639-1 code or a name); None: detect it."""

    task: Literal["transcribe", "translate"] = "transcribe"
    """``translate``: the transcript in English."""

    prompt: str | None = None
    """Context for the decoder (default: the request's ``text``)."""

    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    """None: greedy, warmer only where the text loops."""
