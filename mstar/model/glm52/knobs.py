"""GLM-5.2's deployment knobs: the decode engine's scheduling switches. No CUDA graphs or
fused kernels yet (the MLA + DSA attention is the torch reference, which reads the step's
lengths on the host)."""

from __future__ import annotations

from mstar.model.knobs import OverlapScheduling, PrefillBudget, PrefixCaching


class Glm52Knobs(OverlapScheduling, PrefixCaching, PrefillBudget):
    """``seed`` (dummy weights), ``overlap_scheduling``, ``prefix_caching``, ``max_prefill_tokens``."""
