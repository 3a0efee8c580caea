"""Nemotron-H's deployment knobs."""

from __future__ import annotations

from typing import Literal

from mstar.model.knobs import Knobs


class NemotronHKnobs(Knobs):
    attention_backend: Literal["torch", "triton"] = "torch"
    """The attention layers' paged-attention kernels: ``torch`` (the reference) or ``triton``."""
