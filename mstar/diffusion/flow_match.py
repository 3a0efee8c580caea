"""Flow-matching Euler sampling as FLUX.2 uses it, written as pure functions of per-request state.

A rectified-flow model predicts the velocity ``v = dx/dsigma`` along
``x_sigma = (1 - sigma) * x_0 + sigma * noise``; sampling integrates it from ``sigma = 1`` (noise)
to ``sigma = 0`` (image) with Euler steps ``x <- x + (sigma_next - sigma) * v``.

The schedule follows diffusers' ``FlowMatchEulerDiscreteScheduler`` as the FLUX.2 pipelines drive
it: the base sigmas are ``linspace(1, 1/n, n)``, resolution-dependent ("dynamic") shifting warps
them with ``exp(mu) / (exp(mu) + (1/s - 1))``, where ``mu`` comes from an empirical fit on the
image token count and the step count (``empirical_mu``), and a terminal ``0`` is appended.
Timesteps are ``1000 * sigma`` (the FLUX.2 DiT is fed ``timestep / 1000``).

Nothing here holds mutable state: ``FlowMatchEuler`` is a frozen config, ``timesteps`` returns the
whole schedule for one request, ``step`` maps (latents, velocity, sigma, sigma_next) to the next
latents, and ``initial_noise`` draws from a generator created for that request alone. A request's
loop-carried state is therefore just its latents, its sigma schedule and its step index.
``initial_noise_soon`` draws the same noise on a background thread, for a request that can start
(its text encoder) before its latents are needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["FlowMatchEuler", "empirical_mu"]

# Empirical fit used by the FLUX.2 pipelines: mu is linear in the image token count, at 10 and
# at 200 steps, and interpolated linearly in the step count between the two lines.
_MU_10_STEPS = (8.73809524e-05, 1.89833333)  # (slope per token, intercept)
_MU_200_STEPS = (0.00016927, 0.45666666)
_MU_LARGE_IMAGE = 4300  # above this many tokens only the 200-step line is used

# A few threads draw starting noise off the request path (torch releases the GIL while it draws).
_NOISE_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mstar-noise")

# diffusers scheduler options whose non-default values we do not implement.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "invert_sigmas": False,
    "stochastic_sampling": False,
}


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The shift ``mu`` FLUX.2 uses for ``image_seq_len`` image tokens and ``num_steps`` steps."""
    m200 = _MU_200_STEPS[0] * image_seq_len + _MU_200_STEPS[1]
    if image_seq_len > _MU_LARGE_IMAGE:
        return float(m200)
    m10 = _MU_10_STEPS[0] * image_seq_len + _MU_10_STEPS[1]
    slope = (m200 - m10) / 190.0
    return float(slope * num_steps + (m200 - 200.0 * slope))


@dataclass(frozen=True)
class FlowMatchEuler:
    """Frozen flow-matching Euler scheduler config; every method is a pure function.

    The defaults are FLUX.2's: dynamic exponential shifting, 1000 training timesteps (``shift``
    only applies when ``dynamic_shifting`` is off).
    """

    num_train_timesteps: int = 1000
    dynamic_shifting: bool = True
    time_shift_type: Literal["exponential", "linear"] = "exponential"
    shift: float = 3.0

    def __post_init__(self) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(
                f"time_shift_type must be 'exponential' or 'linear', got {self.time_shift_type!r}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FlowMatchEuler:
        """Build from a diffusers ``scheduler_config.json`` dict. Options that change the schedule
        in ways not implemented here (Karras / exponential / beta sigmas, terminal stretching,
        inverted sigmas, stochastic sampling) raise when set to a non-default value."""
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            if config.get(key, default) not in (default, 0):
                raise ValueError(f"unsupported scheduler option {key}={config[key]!r}")
        return cls(
            num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
            dynamic_shifting=bool(config.get("use_dynamic_shifting", False)),
            time_shift_type=config.get("time_shift_type", "exponential"),
            shift=float(config.get("shift", 1.0)),
        )

    def timesteps(
        self,
        num_steps: int,
        image_seq_len: int,
        *,
        mu: float | None = None,
        sigmas: Sequence[float] | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule of one request: ``(sigmas [num_steps + 1], timesteps [num_steps])``, fp32.

        ``image_seq_len`` is the number of packed image tokens (``(H / 16) * (W / 16)`` for an
        ``H x W`` image); ``mu`` overrides ``empirical_mu(image_seq_len, num_steps)`` and
        ``sigmas`` the base ``linspace(1, 1/num_steps, num_steps)``, as the pipeline's ``sigmas``
        argument does. The last sigma is 0.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        # The arithmetic mirrors diffusers op for op (numpy float32): the values are identical.
        if sigmas is None:
            base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        else:
            if len(sigmas) != num_steps:
                raise ValueError(f"got {len(sigmas)} sigmas for {num_steps} steps")
            base = np.asarray(sigmas)
        s = base.astype(np.float32)
        if self.dynamic_shifting:
            if mu is None:
                mu = empirical_mu(image_seq_len, num_steps)
            scale = math.exp(mu) if self.time_shift_type == "exponential" else mu
            s = scale / (scale + (1 / s - 1))
        else:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        shifted = torch.from_numpy(np.ascontiguousarray(s)).to(dtype=torch.float32, device=device)
        timesteps = shifted * self.num_train_timesteps
        return torch.cat([shifted, shifted.new_zeros(1)]), timesteps

    @staticmethod
    def step(
        latents: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
    ) -> torch.Tensor:
        """One Euler step ``latents + (sigma_next - sigma) * velocity``, in ``velocity.dtype``.

        ``sigma`` / ``sigma_next`` are scalars, or tensors of shape ``[B]`` giving each row of a
        batch its own step. Rounding follows diffusers exactly (bit-identical in fp32 and bf16):
        ``dt`` is formed in fp32 and rounded to the velocity's dtype, the product ``dt * v`` is
        rounded to that dtype, the sum with the latents is formed in fp32 and rounded at the end.
        Each row is computed independently, so batching requests does not change their results.
        """
        start = torch.as_tensor(sigma, dtype=torch.float32, device=velocity.device)
        dt = torch.as_tensor(sigma_next, dtype=torch.float32, device=velocity.device) - start
        if dt.ndim == 1:
            dt = dt.view(-1, *([1] * (velocity.ndim - 1)))
        dtype = velocity.dtype
        update = (dt.to(dtype).float() * velocity.float()).to(dtype)
        return (latents.float() + update.float()).to(dtype)

    @staticmethod
    def initial_noise(
        shape: Sequence[int],
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Starting latents for one request: standard normal noise from a CPU ``torch.Generator``
        seeded with ``seed`` (drawn on the CPU in ``dtype``, then moved), which is what the FLUX.2
        pipeline draws for ``generator=torch.Generator().manual_seed(seed)``. The pipeline draws in
        the patchified latent shape ``(B, 4 * latent_channels, H / 16, W / 16)`` and then flattens
        it to tokens."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(tuple(shape), generator=generator, device="cpu", dtype=dtype).to(device)

    @staticmethod
    def initial_noise_soon(
        shape: Sequence[int],
        seed: int,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Future:
        """``initial_noise(shape, seed)`` (then ``finish`` of it, e.g. the flattening to tokens)
        drawn on a background thread: a ``Future`` of the CPU tensor, which the runtime takes
        as a walk input (it sends the value on once it is drawn, and the steps that read it
        wait for it). Drawing 1024x1024's noise takes a few milliseconds of one core, which
        then overlap the request's first GPU work instead of preceding it."""
        shape = tuple(shape)

        def draw() -> torch.Tensor:
            noise = FlowMatchEuler.initial_noise(shape, seed)
            return (finish(noise) if finish is not None else noise).contiguous()

        return _NOISE_THREADS.submit(draw)
