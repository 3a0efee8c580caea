"""Conditional flow matching sampling of mel frames (CosyVoice2/3, Chatterbox S3Gen), on the
flow-matching primitives the image models use.

The estimator predicts the velocity ``dx/dt`` along ``x_t = (1 - t) * noise + t * mel`` (up to
CosyVoice's ``sigma_min``), so sampling integrates from ``t = 0`` (noise) to ``t = 1`` (mel).
That is the image models' Euler step ``x + (s_next - s) * v`` (``FlowMatchEuler.step``) with
the schedule running upwards: the "sigmas" here are the flow times themselves.

- **Schedule**: ``num_steps + 1`` times ``linspace(0, 1)``, warped by ``1 - cos(t * pi / 2)``
  (``'cosine'``, the released setting: small steps near the noise) or left linear.
- **Guidance**: each step runs the estimator on the conditioned row and on an unconditioned
  row (the same ``x``, zero conditioning stack) and combines them with ``guide`` at scale
  ``1 + cfg_rate`` (CosyVoice writes ``(1 + r) * v_cond - r * v_uncond``; r = 0.7 released).

``CosineFlowSchedule`` has the ``timesteps`` shape of ``FlowMatchEuler``, and ``velocity_fn``
adapts the estimator to the denoise engine's ``velocity(latents, text, t, params)``: a mel
decode can then run as the image models' denoise ``Loop`` with the noisy mel as the
loop-carried latents (``[T, mel]``), the conditioning stack as ``text`` (``[T, 3 * mel]``)
and zeros as ``negative_text``. ``solve_euler`` is the same arithmetic as a plain loop.

The initial noise is an argument. CosyVoice1's sampler draws it per call; the causal
samplers of CosyVoice2/3 and S3Gen slice the first ``T`` frames of one fixed table
(``noise_table``), so a decode of the mel received so far starts from the prefix of the
noise a longer decode starts from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.diffusion.guidance import guide
from mstar.model.flow.estimator import FlowEstimator

__all__ = ["CosineFlowSchedule", "flow_times", "guided_velocity", "noise_table", "solve_euler", "velocity_fn"]


def noise_table(mel_channels: int = 80, frames: int = 50 * 300, seed: int = 0) -> torch.Tensor:
    """The causal samplers' fixed starting noise ``[1, mel, frames]`` (300 s at 50 frames/s):
    standard normal from a CPU generator seeded with ``seed``, the values CosyVoice draws
    from the global generator right after seeding it with 0. A decode of ``T`` frames starts
    from ``table[:, :, :T] * temperature``. Drawn on the CPU in float32 whatever torch's
    default device and dtype (inside ``weights.building``)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(1, mel_channels, frames, generator=generator, device="cpu", dtype=torch.float32)


def flow_times(num_steps: int, schedule: Literal["cosine", "linear"] = "cosine") -> torch.Tensor:
    """The ``num_steps + 1`` flow times from 0 to 1, fp32."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if schedule not in ("cosine", "linear"):
        raise ValueError(f"schedule must be 'cosine' or 'linear', got {schedule!r}")
    t = torch.linspace(0, 1, num_steps + 1, dtype=torch.float32)
    return 1 - torch.cos(t * 0.5 * math.pi) if schedule == "cosine" else t


@dataclass(frozen=True)
class CosineFlowSchedule:
    """A mel decode's schedule in ``FlowMatchEuler.timesteps``'s shape, for the denoise engine:
    ``(times [n + 1], 1000 * times[:-1])``; the engine feeds ``timesteps / 1000`` to the
    velocity and steps ``x + (times[i + 1] - times[i]) * v``."""

    schedule: Literal["cosine", "linear"] = "cosine"

    def timesteps(self, num_steps: int, image_seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        times = flow_times(num_steps, self.schedule)
        return times, times[:-1] * 1000


def guided_velocity(estimator: FlowEstimator, x: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor,
                    t: torch.Tensor, cfg_rate: float, streaming: bool = False) -> torch.Tensor:
    """The guided velocity of ``x`` [B, mel, T] at times ``t`` [B]: conditioned and
    unconditioned rows in one estimator batch. ``cfg_rate`` 0 runs the conditioned row only."""
    if cfg_rate == 0:
        return estimator(x, mask, cond_stack, t, streaming=streaming)
    v = estimator(torch.cat([x, x]), torch.cat([mask, mask]), torch.cat([cond_stack, torch.zeros_like(cond_stack)]),
                  torch.cat([t, t]), streaming=streaming)
    v_cond, v_uncond = v.chunk(2)
    return guide(v_cond, v_uncond, 1.0 + cfg_rate)


def solve_euler(estimator: FlowEstimator, noise: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor,
                num_steps: int = 10, cfg_rate: float = 0.7, schedule: Literal["cosine", "linear"] = "cosine",
                streaming: bool = False) -> torch.Tensor:
    """Mel frames ``[B, mel, T]`` from ``noise`` (already scaled by any temperature) by
    ``num_steps`` guided Euler steps. ``cond_stack`` is ``FlowEstimator.conditioning(mu,
    spks, cond)``; ``mask`` [B, 1, T] marks valid frames."""
    times = flow_times(num_steps, schedule).to(noise.device)
    x = noise
    for i in range(num_steps):
        t = times[i].expand(x.shape[0]).to(x.dtype)
        v = guided_velocity(estimator, x, mask, cond_stack, t, cfg_rate, streaming)
        x = FlowMatchEuler.step(x, v, times[i], times[i + 1])
    return x


def velocity_fn(estimator: FlowEstimator) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]],
                                                       torch.Tensor]:
    """The estimator as the denoise engine's ``velocity``: latents ``[B, T, mel]`` (frames as
    tokens), the conditioning stack as ``text`` ``[B, T, 3 * mel]``, times ``[B]``. Rows of
    one forward share a length, so every frame is valid. A request param ``streaming`` picks
    chunked attention; the engine batches by shape alone, so rows that differ in it run as
    separate estimator calls."""

    def velocity(latents: torch.Tensor, text: torch.Tensor, t: torch.Tensor, params: list[dict]) -> torch.Tensor:
        flags = [bool(p.get("streaming", False)) for p in params] or [False] * latents.shape[0]
        out = torch.empty_like(latents)
        for streaming in set(flags):
            rows = torch.tensor([i for i, f in enumerate(flags) if f == streaming], device=latents.device)
            x = latents[rows].transpose(1, 2)
            mask = x.new_ones(x.shape[0], 1, x.shape[-1])
            out[rows] = estimator(x, mask, text[rows].transpose(1, 2), t[rows], streaming=streaming).transpose(1, 2)
        return out

    return velocity
