"""LTX-2.x sampling: the distilled recipe's schedule, token packing, and a reference loop.

The distilled checkpoints run eight fixed sigmas (``DISTILLED_SIGMAS``) with no guidance: each
step is one DiT evaluation on the video and audio tokens together, then an Euler step of each
stream with the same sigmas (diffusers keeps a copy of the scheduler per stream; both follow
one schedule). The sigmas pass through the scheduler's shifting as ``LTX2Pipeline`` does:
``mu`` is linear in the video token count (0.95 at 1024 tokens to 2.05 at 4096 unless the
scheduler config says otherwise), applied only when the config asks for dynamic shifting, and
an optional stretch so the last sigma lands on ``shift_terminal``.

``sample`` is the eager reference loop (the serving graph runs the same steps inside its
denoise ``Loop``); ``frame_count``/``audio_frame_count`` give the latent sizes of a request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.model.ltx2_5.transformer import LtxTransformer
from mstar.model.z_image.schedule import linear_mu

DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875)  # the two-stage recipe's full-size pass


@dataclass(frozen=True)
class LtxSchedule:
    """The scheduler config's keys that shape LTX's schedule (a ``scheduler_config.json``)."""

    euler: FlowMatchEuler
    shift_terminal: float | None = None
    base_image_seq_len: int = 1024
    max_image_seq_len: int = 4096
    base_shift: float = 0.95
    max_shift: float = 2.05

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LtxSchedule:
        terminal = config.get("shift_terminal") or None
        euler = FlowMatchEuler.from_config({k: v for k, v in config.items() if k != "shift_terminal"})
        return cls(euler=euler, shift_terminal=None if terminal is None else float(terminal),
                   base_image_seq_len=int(config.get("base_image_seq_len", 1024)),
                   max_image_seq_len=int(config.get("max_image_seq_len", 4096)),
                   base_shift=float(config.get("base_shift", 0.95)), max_shift=float(config.get("max_shift", 2.05)))

    def sigmas(self, video_tokens: int, sigmas: Sequence[float] = DISTILLED_SIGMAS,
               device: torch.device | None = None) -> torch.Tensor:
        """``[len(sigmas) + 1]`` float32, ending in 0; the DiT's time is ``1000 x sigma``."""
        mu = linear_mu(video_tokens, self.base_image_seq_len, self.max_image_seq_len, self.base_shift,
                       self.max_shift)
        shifted, _ = self.euler.timesteps(len(sigmas), video_tokens, mu=mu, sigmas=sigmas)
        if self.shift_terminal is not None:
            s = shifted[:-1].numpy()
            rest = 1 - s
            s = 1 - rest / (rest[-1] / (1 - self.shift_terminal))
            shifted = torch.cat([torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)), shifted[-1:]])
        return shifted.to(device)


def frame_count(num_frames: int, temporal_ratio: int = 8) -> int:
    """Latent frames of a ``num_frames`` video (``1 + 8k`` frames -> ``1 + k``)."""
    return (num_frames - 1) // temporal_ratio + 1


def audio_frame_count(num_frames: int, fps: float, sample_rate: int = 16000, hop: int = 160,
                      ratio: int = 4) -> int:
    """Audio latent frames covering the video's duration (25 per second at the defaults)."""
    return round(num_frames / fps * (sample_rate / hop / ratio))


def pack_video(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, F, H, W]`` -> tokens ``[B, F * H * W, C]`` (frame-major, patch size 1)."""
    return latents.flatten(2).transpose(1, 2)


def unpack_video(tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    return tokens.transpose(1, 2).unflatten(2, grid)


def normalize_audio(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Audio latents ``[B, C, T, bins]`` -> normalised tokens ``[B, T, C * bins]``."""
    tokens = latents.transpose(1, 2).flatten(2)
    return (tokens - mean.to(tokens)) / std.to(tokens)


@torch.no_grad()
def sample(dit: LtxTransformer, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor,
           audio_text: torch.Tensor, text_mask: torch.Tensor, grid: tuple[int, int, int], fps: float,
           sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise ``video [B, N, C]`` and ``audio [B, M, Ca]`` tokens (float32, starting at
    ``sigmas[0]``) through ``sigmas`` (ending in 0) without guidance; returns the clean tokens."""
    video_coords = dit.video_coords(grid, fps, video.device)
    audio_coords = dit.audio_coords(audio.shape[1], audio.device)
    dtype = text.dtype
    for i in range(len(sigmas) - 1):
        t = (sigmas[i] * 1000).expand(video.shape[0])
        v_video, v_audio = dit(video.to(dtype), audio.to(dtype), text, audio_text, t, video_coords=video_coords,
                               audio_coords=audio_coords, text_mask=text_mask)
        video = FlowMatchEuler.step(video, v_video.float(), sigmas[i], sigmas[i + 1])
        audio = FlowMatchEuler.step(audio, v_audio.float(), sigmas[i], sigmas[i + 1])
    return video, audio
