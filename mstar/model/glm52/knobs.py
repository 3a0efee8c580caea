"""GLM-5.2's deployment knobs: the decode engine's scheduling switches. No CUDA graphs or
fused kernels yet (the MLA + DSA attention is the torch reference, which reads the step's
lengths on the host)."""

from __future__ import annotations

from mstar.model.knobs import OverlapScheduling, PrefillBudget, PrefixCaching, require_cuda


class Glm52Knobs(OverlapScheduling, PrefixCaching, PrefillBudget):
    """``seed`` (dummy weights), ``overlap_scheduling``, ``prefix_caching``, ``max_prefill_tokens``,
    ``fp8_gemm``."""

    fp8_gemm: bool = False
    """Keep the checkpoint's fp8 block-scaled weights of the whole (unsplit) linear layers and
    run them on torch's block-scaled fp8 GEMM (activations quantised per 1x128 group; Hopper,
    CUDA only; ``mstar.model.glm52.fp8``). Off: every weight dequantised to the model's dtype."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.fp8_gemm:
            require_cuda("fp8_gemm", device)
