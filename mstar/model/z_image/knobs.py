"""Z-Image-Turbo's deployment knobs: the diffusion families' (``DiffusionKnobs``), 8 steps by
default. It takes neither ``cuda_graphs`` nor ``fused_kernels``: it implements neither."""

from __future__ import annotations

from mstar.model.diffusion_knobs import DiffusionKnobs, Steps


class ZImageKnobs(DiffusionKnobs):
    num_inference_steps: Steps = 8  # the distilled Turbo checkpoint (diffusers' example and the model card)
