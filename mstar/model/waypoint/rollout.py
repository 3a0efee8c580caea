"""A Waypoint rollout: the seed frame in, then one control in and one latent frame out per step.

``Rollout`` is the whole per-rollout state: the DiT's keys and values of past frames
(``FrameKV``), the TAEHV decoder's frame memory, the noise generator, the next frame's index and
the last clean latent. Nothing else is kept between steps, so a session store can hold a
``Rollout`` between requests and a client can send one control at a time.

``WaypointWorld.step`` is the reference's per-frame sampler: Gaussian noise, Euler steps of the
rectified flow down the checkpoint's ``scheduler_sigmas`` (``x += (sigma_next - sigma) * v``)
with the cache read but not written, then one clean pass (sigma 0) of the result that writes
its keys and values for later frames; the latent is decoded to ``time_upscale`` RGB frames.
``start`` encodes the seed image and runs its clean pass (zero control), as the reference's
``append_frame``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mstar.model.waypoint.dit import FrameKV, WorldDiT
from mstar.model.waypoint.taehv import TAEHV, StreamingDecoder

# The autoencoder's 16:8 frames -> the 16:9 frames shown, as the reference resizes them
# (bilinear both ways: a seed image is resized to the autoencoder's size on the way in).
DISPLAY_SIZES = {(512, 1024): (720, 1280), (256, 512): (360, 640)}


@dataclass
class Rollout:
    kv: FrameKV
    decoder: StreamingDecoder
    noise: torch.Generator
    frame: int = 0  # the index of the next frame
    latent: torch.Tensor | None = field(default=None, repr=False)  # the last clean latent [1, C, h, w]


class WaypointWorld:
    """The DiT and the autoencoder on one device, and the per-frame sampler over them."""

    def __init__(self, dit: WorldDiT, tae: TAEHV, device: torch.device, dtype: torch.dtype = torch.float32):
        if dit.config.channels != tae.config.latent_channels:
            raise ValueError(f"the DiT takes {dit.config.channels}-channel latents, the autoencoder makes "
                             f"{tae.config.latent_channels}")
        self.dit, self.tae, self.device, self.dtype = dit, tae, device, dtype
        c = dit.config
        scale = tae.config.space_scale
        self.latent_shape = (c.channels, c.height * c.patch[0], c.width * c.patch[1])
        self.pixel_size = (self.latent_shape[1] * scale, self.latent_shape[2] * scale)  # (height, width)
        self.display_size = DISPLAY_SIZES.get(self.pixel_size, self.pixel_size)
        self.sigmas = c.scheduler_sigmas

    def new_rollout(self, seed: int) -> Rollout:
        return Rollout(FrameKV(self.dit.config), StreamingDecoder(self.tae),
                       torch.Generator().manual_seed(int(seed)))

    @torch.inference_mode()
    def start(self, rollout: Rollout, pixels: torch.Tensor) -> torch.Tensor:
        """The seed image ``[3, H, W]`` in [0, 1] at the autoencoder's size -> its latent (the
        image taken as ``time_downscale`` identical frames), appended as frame 0 with a zero
        control. It is not decoded: the client has the image."""
        if rollout.frame:
            raise ValueError("the rollout has started already")
        video = pixels.to(self.device, self.dtype)[None, None]
        latent = self.tae.encode_whole(video)[:, 0]
        self._append(rollout, latent, torch.zeros(self.dit.config.control_dim))
        return latent

    @torch.inference_mode()
    def step(self, rollout: Rollout, control: torch.Tensor) -> torch.Tensor:
        """One control ``[control_dim]`` -> the next frames, uint8 ``[time_upscale, H, W, 3]``
        at the display size."""
        latent = self.generate_latent(rollout, control)
        frames = rollout.decoder.push(latent[:, None])[0]  # [T, 3, h, w] in [0, 1]
        if tuple(frames.shape[-2:]) != self.display_size:
            frames = F.interpolate(frames, size=self.display_size, mode="bilinear", align_corners=False)
        return (frames.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()

    def generate_latent(self, rollout: Rollout, control: torch.Tensor) -> torch.Tensor:
        if rollout.frame >= self.dit.config.n_frames:
            raise ValueError(f"the rollout has reached the model's {self.dit.config.n_frames}-frame context")
        noise = torch.randn((1, 1, *self.latent_shape), generator=rollout.noise)
        x = noise.to(self.device, self.dtype)
        ctrl = control.to(self.device, self.dtype).view(1, 1, -1)
        for sigma, following in zip(self.sigmas, self.sigmas[1:]):
            s = torch.full((1, 1), sigma, device=self.device, dtype=self.dtype)
            x = x + (following - sigma) * self.dit(x, s, rollout.frame, ctrl, rollout.kv)
        latent = x[:, 0]
        self._append(rollout, latent, control)
        return latent

    def _append(self, rollout: Rollout, latent: torch.Tensor, control: torch.Tensor) -> None:
        """The clean pass: frame ``rollout.frame``'s keys and values into the cache."""
        zero = torch.zeros((1, 1), device=self.device, dtype=self.dtype)
        ctrl = control.to(self.device, self.dtype).view(1, 1, -1)
        self.dit(latent[:, None], zero, rollout.frame, ctrl, rollout.kv, persist=True)
        rollout.frame += 1
        rollout.latent = latent
