"""The fixed-sigma stochastic sampler of Cosmos3's 4-step distilled checkpoints.

Distilled checkpoints (``distilled_sigmas`` in ``modular_model_index.json``, guidance baked into
the weights) fix their schedule: the listed sigmas, shifted by the scheduler folder's ``shift``
as diffusers' ``FlowMatchEulerDiscreteScheduler`` shifts custom sigmas, then a terminal 0; the
tower sees ``1000 * sigma`` (not rounded). Each step is stochastic (the scheduler's
``stochastic_sampling``): the clean estimate ``x0 = x - sigma * v`` is re-noised to the next
sigma with fresh noise, ``x' = (1 - sigma_next) * x0 + sigma_next * noise``. The noise comes from
the request's generator after its starting latents, one draw of the latents' shape per step, so
a request carries ``step_noise [steps, ...]`` drawn with its seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.diffusion.flow_match import FlowMatchEuler


@dataclass(frozen=True)
class FixedSigmas:
    sigmas: tuple[float, ...]
    flow: FlowMatchEuler

    @classmethod
    def from_config(cls, config: Mapping[str, Any], sigmas: Sequence[float]) -> FixedSigmas:
        """From the scheduler folder's ``scheduler_config.json`` and the distilled sigmas; a
        deterministic scheduler config is refused (the checkpoints sample stochastically)."""
        if not config.get("stochastic_sampling", False):
            raise ValueError("a distilled Cosmos3 checkpoint needs stochastic_sampling in its scheduler config")
        if not sigmas:
            raise ValueError("distilled_sigmas is empty")
        rest = {k: v for k, v in config.items() if k != "stochastic_sampling"}
        return cls(tuple(float(s) for s in sigmas), FlowMatchEuler.from_config(rest))

    @property
    def num_steps(self) -> int:
        return len(self.sigmas)

    def timesteps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [n + 1] float32, timesteps [n] float32)``."""
        return self.flow.timesteps(self.num_steps, 0, sigmas=self.sigmas)

    @staticmethod
    def step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             noise: torch.Tensor) -> torch.Tensor:
        """One stochastic step, in float32 as the scheduler computes it."""
        x0 = latents - sigma * velocity
        return (1.0 - sigma_next) * x0 + sigma_next * noise


def draws(shape: Sequence[int], seed: int, count: int) -> torch.Tensor:
    """``count`` standard-normal tensors of ``shape`` drawn one after another from one CPU
    generator seeded with ``seed`` (the first is the starting latents), stacked ``[count, ...]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(tuple(shape), generator=generator) for _ in range(count)])
