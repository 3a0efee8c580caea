"""Classifier-free guidance: one velocity from a conditional and an unconditional prediction.

``v = v_uncond + g * (v_cond - v_uncond)``, the form the FLUX.2 pipelines (and most flow and
diffusion pipelines) use, with no renormalisation afterwards. A guidance scale of 1 gives the
conditional prediction; larger scales push away from the unconditional one.
"""

from __future__ import annotations

import torch

__all__ = ["guide"]


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """The guided velocity, in the predictions' dtype.

    ``scale`` is a number, or a tensor of shape ``[B]`` giving each row of a batch its own
    scale. Rounding matches a pipeline that computes ``neg + scale * (pos - neg)`` with a
    Python float scale: the difference is rounded to the predictions' dtype, the product is
    formed in fp32 and rounded, and the sum is formed in fp32 and rounded. Rows are computed
    independently, so batching requests does not change their results.
    """
    dtype = v_cond.dtype
    if isinstance(scale, torch.Tensor) and scale.ndim == 1:
        g = scale.to(v_cond.device, torch.float32).view(-1, *([1] * (v_cond.ndim - 1)))
    else:  # a 0-dim host tensor enters the product as a value: no copy up, no wait for the GPU
        g = torch.as_tensor(scale, dtype=torch.float32, device="cpu")
    delta = v_cond - v_uncond
    return (v_uncond.float() + (g * delta.float()).to(dtype).float()).to(dtype)
