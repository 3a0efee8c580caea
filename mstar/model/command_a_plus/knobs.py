"""Command A+'s deployment knobs (``model_kwargs``) and its ``/generate`` options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.chat import GenerateKnobs
from mstar.model.knobs import Knobs

SAMPLING_DEFAULTS = {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.04}
"""The release's sampling defaults, for a request that sends none of its own."""


class CommandAPlusKnobs(Knobs):
    moe_kernel: Literal["loop", "grouped_mm", "triton"] = "loop"
    """How the routed experts run (``mstar.layers.moe``): ``loop`` (the reference, one GEMM
    pair per expert), ``grouped_mm`` (``torch._grouped_mm``) or ``triton`` (the fused MoE
    kernels; CUDA)."""

    max_image_pixels: int = Field(12 * 512 * 512 * 4, ge=1)
    """The most pixels (width x height) an image may have before tiling."""

    max_images: int = Field(4, ge=0)
    """Images per request at most."""


class CommandAPlusGenerateKnobs(GenerateKnobs):
    """``/generate``'s ``model_kwargs``: the chat LLM's (sampling defaults to the release's)."""
