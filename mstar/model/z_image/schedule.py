"""Z-Image's sampling schedule, as ``ZImagePipeline`` drives diffusers' flow-match Euler scheduler.

Three differences from FLUX.2's use of the same scheduler:

* the base sigmas are ``torch.linspace(1, 1/n, n)`` in float32 (not numpy's float64 linspace);
* with dynamic shifting, ``mu`` is the FLUX.1 linear fit in the image token count
  (``base_shift`` at ``base_image_seq_len`` tokens to ``max_shift`` at ``max_image_seq_len``);
  Z-Image-Turbo's scheduler uses a static ``shift`` of 3 instead;
* the DiT's time runs the other way: it is fed ``(1000 - timestep) / 1000`` (0 = noise).
  ``timesteps`` therefore returns ``1000 - timestep`` as the time the denoise engine hands the
  DiT (divided by 1000), computed in float32 exactly as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.diffusion.flow_match import FlowMatchEuler

__all__ = ["ZImageSchedule", "linear_mu"]

# Z-Image-Turbo's scheduler_config.json.
TURBO_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}


def linear_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
              base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """``mu`` on the line through ``(base_seq_len, base_shift)`` and ``(max_seq_len, max_shift)``."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


@dataclass(frozen=True)
class ZImageSchedule(FlowMatchEuler):
    dynamic_shifting: bool = False
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ZImageSchedule:
        """Build from a diffusers ``scheduler_config.json`` dict (see ``FlowMatchEuler.from_config``)."""
        base = FlowMatchEuler.from_config(config)
        return cls(
            num_train_timesteps=base.num_train_timesteps, dynamic_shifting=base.dynamic_shifting,
            time_shift_type=base.time_shift_type, shift=base.shift,
            base_image_seq_len=int(config.get("base_image_seq_len", 256)),
            max_image_seq_len=int(config.get("max_image_seq_len", 4096)),
            base_shift=float(config.get("base_shift", 0.5)), max_shift=float(config.get("max_shift", 1.15)))

    def timesteps(self, num_steps: int, image_seq_len: int, *, mu: float | None = None,
                  sigmas: Sequence[float] | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [num_steps + 1], DiT time x 1000 [num_steps])`` for one request."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if sigmas is None:
            sigmas = torch.linspace(1.0, 1 / num_steps, num_steps).tolist()
        if mu is None and self.dynamic_shifting:
            mu = linear_mu(image_seq_len, self.base_image_seq_len, self.max_image_seq_len,
                           self.base_shift, self.max_shift)
        shifted, timesteps = super().timesteps(num_steps, image_seq_len, mu=mu, sigmas=sigmas, device=device)
        return shifted, 1000 - timesteps  # the pipeline's literal 1000, whatever num_train_timesteps
