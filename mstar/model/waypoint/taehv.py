"""TAEHV, the tiny video autoencoder (madebyollin/taehv), as Waypoint uses it: the seed frame in,
live RGB frames out.

Both halves are plain chains of 2-D blocks over frames; time enters in three kinds of block only:
a memory block sees its own input of the previous frame (zeros before the first), a pool block
folds ``stride`` consecutive frames into one (channels side by side), a grow block unfolds one
frame into ``stride``. Because no block looks ahead in time, a video can be run either all at
once (``run_whole``: every block over all frames, the memory as the input shifted by one frame)
or frame by frame (``TimeStream``: each block keeps its last input or its partial pool), with the
same result; the rollout decodes frame by frame. Module indices follow the reference's
``nn.Sequential`` so its state dict (``encoder.N.*``, ``decoder.N.*``) loads by name. Only the
base decoder (not the "super" variant) is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.waypoint.config import TAEHVConfig


def conv3(n_in: int, n_out: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


class SoftClamp(nn.Module):
    """``3 tanh(x / 3)``: latents squashed into (-3, 3) before decoding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """A residual 3-conv block over ``[x, x of the previous frame]``."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv = nn.Sequential(conv3(2 * n_in, n_out), nn.ReLU(), conv3(n_out, n_out), nn.ReLU(),
                                  conv3(n_out, n_out))
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat((x, past), 1)) + self.skip(x))


class TPool(nn.Module):
    """``stride`` consecutive frames -> one (a 1x1 conv over their channels side by side)."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f * stride, n_f, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N*T, C, H, W], T a multiple of stride
        _, c, h, w = x.shape
        return self.conv(x.reshape(-1, self.stride * c, h, w))


class TGrow(nn.Module):
    """One frame -> ``stride`` consecutive frames (a 1x1 conv, its channels split in order)."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f, n_f * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        return self.conv(x).reshape(-1, c, h, w)


def _stride(flag: bool) -> int:
    return 2 if flag else 1


class TAEHV(nn.Module):
    """``encoder``: RGB frames in [0, 1] -> latents; ``decoder``: latents -> RGB in [0, 1]."""

    def __init__(self, config: TAEHVConfig):
        super().__init__()
        self.config = config
        p2 = config.patch_size ** 2
        t_enc, t_dec, s_dec = config.encoder_time_downscale, config.decoder_time_upscale, config.decoder_space_upscale
        enc: list[nn.Module] = [conv3(3 * p2, 64), nn.ReLU()]
        for flag in t_enc:
            enc += [TPool(64, _stride(flag)), conv3(64, 64, stride=2, bias=False),
                    *(MemBlock(64, 64) for _ in range(3))]
        enc.append(conv3(64, config.latent_channels))
        self.encoder = nn.Sequential(*enc)
        widths = (256, 128, 64, 64)
        dec: list[nn.Module] = [SoftClamp(), conv3(config.latent_channels, widths[0]), nn.ReLU()]
        for i in range(3):
            n = widths[i]
            dec += [*(MemBlock(n, n) for _ in range(3)), nn.Upsample(scale_factor=_stride(s_dec[i])),
                    TGrow(n, _stride(t_dec[i])), conv3(n, widths[i + 1], bias=False)]
        dec += [nn.ReLU(), conv3(widths[3], 3 * p2)]
        self.decoder = nn.Sequential(*dec)

    # ------------------------------------------------------------ whole videos
    def encode_whole(self, video: torch.Tensor) -> torch.Tensor:
        """``[N, T, 3, H, W]`` in [0, 1] -> ``[N, T / time_downscale, C, H / s, W / s]``; T is
        padded up to a multiple of the time compression with copies of the last frame."""
        return run_whole(self.encoder, self.to_encoder(video))

    def decode_whole(self, latents: torch.Tensor) -> torch.Tensor:
        """``[N, T, C, h, w]`` -> ``[N, T * time_upscale - (time_upscale - 1), 3, H, W]`` in [0, 1]:
        the first frames of a video's decode are warm-up and are cut, as the reference does."""
        frames = self.from_decoder(run_whole(self.decoder, latents))
        return frames[:, self.config.time_upscale - 1:]

    def to_encoder(self, video: torch.Tensor) -> torch.Tensor:
        short = -video.shape[1] % self.config.time_downscale
        if short:
            video = torch.cat((video, video[:, -1:].expand(-1, short, -1, -1, -1)), 1)
        return self.pixels_in(video)

    def pixels_in(self, video: torch.Tensor) -> torch.Tensor:
        """RGB frames as the encoder's first block takes them (pixel-unshuffled)."""
        n, t = video.shape[:2]
        x = video.flatten(0, 1)
        if self.config.patch_size > 1:
            x = F.pixel_unshuffle(x, self.config.patch_size)
        return x.view(n, t, *x.shape[1:])

    def from_decoder(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.shape[:2]
        x = x.flatten(0, 1)
        if self.config.patch_size > 1:
            x = F.pixel_shuffle(x, self.config.patch_size)
        return x.clamp(0, 1).view(n, t, *x.shape[1:])


def run_whole(chain: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Every block over all ``[N, T, ...]`` frames at once."""
    n = x.shape[0]
    x = x.flatten(0, 1)
    for block in chain:
        if isinstance(block, MemBlock):
            frames = x.view(n, -1, *x.shape[1:])
            past = F.pad(frames, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]  # zeros, then frames shifted by one
            x = block(x, past.flatten(0, 1))
        else:
            x = block(x)
    return x.view(n, -1, *x.shape[1:])


class TimeStream:
    """A chain run frame by frame: ``push`` any number of new frames, get the frames they
    complete. Holds each memory block's last input and each pool block's partial group: part of
    a rollout's state."""

    def __init__(self, chain: nn.Sequential):
        self.chain = chain
        self.memory: list[torch.Tensor | list[torch.Tensor] | None] = [None] * len(chain)

    def push(self, frames: torch.Tensor) -> torch.Tensor | None:
        """``[N, T, C, H, W]`` -> ``[N, T', C', H', W']`` (None when a pool still waits for more)."""
        xs = list(frames.unbind(1))
        for i, block in enumerate(self.chain):
            out: list[torch.Tensor] = []
            for x in xs:
                if isinstance(block, MemBlock):
                    past = self.memory[i]
                    out.append(block(x, torch.zeros_like(x) if past is None else past))
                    self.memory[i] = x
                elif isinstance(block, TPool):
                    group = self.memory[i] = (self.memory[i] or []) + [x]
                    if len(group) == block.stride:
                        out.append(block(torch.stack(group, 1).flatten(0, 1)))
                        self.memory[i] = []
                elif isinstance(block, TGrow):
                    grown = block(x)  # [N * stride, C, H, W], frame-major within each video
                    out.extend(grown.view(x.shape[0], block.stride, *grown.shape[1:]).unbind(1))
                else:
                    out.append(block(x))
            xs = out
            if not xs:
                return None
        return torch.stack(xs, 1)


class StreamingDecoder:
    """Latent frames in, RGB frames in [0, 1] out, one latent at a time, ``time_upscale`` frames
    each. The stream is primed as the reference's world-model decode primes it: the first
    latent goes in ``time_upscale`` times and only the last pass's frames come out (the first
    passes fill the memory blocks and absorb the warm-up frames ``decode_whole`` cuts)."""

    def __init__(self, tae: TAEHV):
        self.tae = tae
        self.stream = TimeStream(tae.decoder)
        self.primed = False

    def push(self, latent: torch.Tensor) -> torch.Tensor:
        """``[N, 1, C, h, w]`` -> ``[N, time_upscale, 3, H, W]``."""
        if not self.primed:
            for _ in range(self.tae.config.time_upscale - 1):
                self.stream.push(latent)
            self.primed = True
        return self.tae.from_decoder(self.stream.push(latent))
