"""FLUX.2 [klein]'s deployment knobs: the diffusion families' (``DiffusionKnobs``), 4 steps by
default, and the two switches klein implements; klein base adds its guidance."""

from __future__ import annotations

from pydantic import Field

from mstar.model.diffusion_knobs import DiffusionKnobs, Steps
from mstar.model.knobs import CudaGraphs, FusedKernels


class Flux2Knobs(DiffusionKnobs, CudaGraphs, FusedKernels):
    """``cuda_graphs``: the text encoder replayed from a CUDA graph per (batch, length);
    ``fused_kernels``: the DiT's per-head QK-norm and RoPE as one Triton kernel."""

    num_inference_steps: Steps = 4  # the distilled klein checkpoints


class Flux2GuidedKnobs(Flux2Knobs):
    """The non-distilled klein checkpoints, sampled with classifier-free guidance."""

    num_inference_steps: Steps = 50  # diffusers' Flux2KleinPipeline default for the base checkpoints

    guidance_scale: float = Field(4.0, ge=1, allow_inf_nan=False)
    """The guidance of requests that do not send one (1 turns guidance off)."""

    cfg_parallel: bool = False
    """Guidance as two ``Parallel`` branches (``dit`` and ``dit_uncond``) instead of a batched pair."""
