"""The Llama family's deployment knobs: the shared decode engine's, and weight quantisation."""

from __future__ import annotations

from mstar.model.knobs import DecodeKnobs, Quantization


class LlamaKnobs(DecodeKnobs, Quantization):
    """``DecodeKnobs`` plus ``quantization`` (CPU, weight-only; see ``mstar.model.quantize``)."""
