"""The sampler of Chatterbox Turbo's S3Gen: a mean-flow estimator in two plain Euler steps.

Turbo's flow estimator is the S3Gen U-Net trained for the mean velocity over a whole interval
``[t, r]`` rather than the instantaneous one at ``t`` (MeanFlow; the two times' embeddings are
mixed by ``time_embed_mixer``, see ``EstimatorConfig.meanflow``). One step of length
``r - t`` then lands near where the exact flow would, so Turbo samples with ``n`` (2) steps of
``x + (r - t) * v(x, t, r)`` on the linear schedule ``linspace(0, 1, n + 1)``, and without
classifier-free guidance (one estimator row per step, not two).
"""

from __future__ import annotations

import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.model.flow import FlowEstimator

__all__ = ["solve_meanflow"]


def solve_meanflow(estimator: FlowEstimator, noise: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor,
                   num_steps: int = 2) -> torch.Tensor:
    """Mel frames ``[B, mel, T]`` from ``noise`` by ``num_steps`` mean-flow Euler steps over
    ``[0, 1]``. ``cond_stack`` and ``mask`` as for ``solve_euler``."""
    if not estimator.config.meanflow:
        raise ValueError("solve_meanflow needs a meanflow estimator (EstimatorConfig(meanflow=True))")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    times = torch.linspace(0, 1, num_steps + 1, dtype=noise.dtype, device=noise.device)
    x = noise
    for t, r in zip(times[:-1], times[1:]):
        v = estimator(x, mask, cond_stack, t.expand(x.shape[0]), r=r.expand(x.shape[0]))
        x = FlowMatchEuler.step(x, v, t, r)
    return x
