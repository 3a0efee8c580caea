"""The distilled few-step sampler of one chunk, and the state of a rollout between chunks.

Schedule: the reference's 1000-step flow schedule (sigmas from ``1 - 1/1000`` down to 0,
shifted ``s -> shift s / (1 + (shift - 1) s)``), of which the distilled model takes the steps at
``timestep_indices`` (0, 250, 500, 750). The DiT sees each step's time as the whole number
``floor(1000 sigma)``, as the reference feeds its integer timesteps.

A step predicts the flow ``v`` and the clean chunk ``x0 = x - sigma v``; before the next step
``x0`` is noised afresh to that step's sigma, ``(1 - sigma') x0 + sigma' noise``. The last
step's ``x0`` is the chunk; one more forward at time 0 on it commits its keys and values to the
rolling cache, so the next chunk attends to the clean past.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.model.lingbot.cache import RollingKV
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.transformer import LingbotTransformer


def distilled_schedule(config: LingbotConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps [S], sigmas [S])`` float64 of the distilled steps."""
    n = config.num_train_timesteps
    index = torch.tensor(config.timestep_indices, dtype=torch.float64)
    base = (1.0 - 1.0 / n) * (1.0 - index / n)
    sigmas = config.shift * base / (1.0 + (config.shift - 1.0) * base)
    return torch.floor(sigmas * n), sigmas


@dataclass
class Rollout:
    """Everything one rollout carries from a chunk to the next: the rolling KV cache, the prompt
    features, the chunks made so far and the sampler's random stream. A session can keep it and
    resume: the next chunk continues where the last one ended."""

    cache: RollingKV
    text: torch.Tensor  # [1, L, text_dim], the prompt's features (zero-padded)
    generator: torch.Generator
    chunks: int = 0
    last_latents: torch.Tensor | None = None  # the last chunk's clean latents [1, C, f, h, w]
    extra: dict = field(default_factory=dict)  # per-family state (the VAE caches)


def denoise_chunk(dit: LingbotTransformer, rollout: Rollout, condition: torch.Tensor, camera: torch.Tensor | None,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """Sample the next chunk's clean latents ``[1, C, f, h, w]`` (float32) and commit it to
    ``rollout``. ``condition [1, in - C, f, h, w]``: the mask and image-latent channels;
    ``camera [1, camera_channels, f, h, w]``: the chunk's rays."""
    device = condition.device
    timesteps, sigmas = distilled_schedule(dit.config)
    gen = rollout.generator
    x = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).to(device)
    dtype = dit.proj_out.weight.dtype
    text = rollout.text.to(device, dtype)

    def flow(latents: torch.Tensor, t: float, commit: bool = False) -> torch.Tensor:
        inp = torch.cat([latents, condition.to(latents)], dim=1).to(dtype)
        time = torch.full((latents.shape[0],), t, device=device)
        cam = None if camera is None else camera.to(dtype)
        return dit(inp, time, text, cam, rollout.cache, commit=commit).float()

    x0 = x
    for step, (t, sigma) in enumerate(zip(timesteps.tolist(), sigmas.tolist())):
        x0 = (x.double() - sigma * flow(x, t).double()).float()
        if step + 1 < len(sigmas):
            noise = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).to(device)
            nxt = sigmas[step + 1].item()
            x = (1 - nxt) * x0 + nxt * noise
    flow(x0, 0.0, commit=True)
    rollout.chunks += 1
    rollout.last_latents = x0
    return x0
