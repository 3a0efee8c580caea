"""The velocity estimator of the conditional flow-matching mel decoder (CosyVoice2/3, Chatterbox S3Gen).

A 1-D U-Net over mel frames. Its input is the noisy mel ``x`` stacked along channels with a
per-frame conditioning stack (the encoder output ``mu``, the speaker embedding repeated over
time, and the prompt mel ``cond``, zero past the prompt). Each level is a ResNet block that
adds a projection of the time embedding, then a few pre-norm transformer blocks (self-attention
and a GELU feed-forward) over the frames, then a resampling convolution; the up path takes the
down path's outputs as skip connections. Every convolution sees its input multiplied by the
frame mask, and the output is masked.

``causal=True`` is the streaming variant CosyVoice2/3 and S3Gen ship: convolutions pad on the
left only, blocks normalise each frame with LayerNorm instead of GroupNorm, and with
``streaming=True`` attention sees only keys up to the end of the query's chunk of
``static_chunk_size`` frames. With one U-Net level (the released geometry) an output frame
then depends on no frame past its chunk, so decoding a prefix of whole chunks gives the
prefix of the whole decode. Deeper U-Nets resample with a centred stride-2 convolution and
lose that property, as the reference does.

Parameter names follow the released ``flow.pt`` under ``decoder.estimator.`` through
``estimator_name_map``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EstimatorConfig", "FlowEstimator", "chunk_attention_mask", "estimator_name_map", "timestep_features"]


@dataclass(frozen=True)
class EstimatorConfig:
    """The defaults are CosyVoice2-0.5B's ``flow.decoder.estimator`` (S3Gen uses the same)."""

    mel_channels: int = 80  # x and the output
    cond_channels: int = 240  # mu, speaker embedding and prompt mel, stacked
    channels: tuple[int, ...] = (256,)  # width of each U-Net level
    num_heads: int = 8
    head_dim: int = 64
    blocks_per_level: int = 4  # transformer blocks after each ResNet block
    mid_levels: int = 12
    causal: bool = True
    static_chunk_size: int = 50  # frames of one attention chunk when streaming
    left_chunks: int = -1  # chunks to the left a query may see when streaming; -1: all
    meanflow: bool = False
    """Chatterbox Turbo's S3Gen: the estimator also reads the step's end time ``r`` and mixes the
    two time embeddings (``time_embed_mixer``), predicting the mean velocity over ``[t, r]``."""

    @property
    def in_channels(self) -> int:
        return self.mel_channels + self.cond_channels

    @property
    def time_dim(self) -> int:
        return 4 * self.channels[0]


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of flow time ``t`` [B] in [0, 1] (scaled by 1000): ``[B, dim]``,
    sines of the ``dim / 2`` geometric frequencies first, then cosines."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = 1000 * t.reshape(-1, 1).float() * freqs
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


def chunk_attention_mask(mask: torch.Tensor, chunk: int = 0, left_chunks: int = -1) -> torch.Tensor:
    """Which keys each query may see: ``[B, T, T]`` bool from the frame mask ``[B, 1, T]``.
    ``chunk`` 0: every valid key; else keys up to the end of the query's chunk, and with
    ``left_chunks >= 0`` none before the start of the chunk that many chunks back. A query left
    with no key sees every key (its output is masked later)."""
    valid = mask.bool()
    length = mask.shape[-1]
    if chunk > 0:
        pos = torch.arange(length, device=mask.device)
        block = pos // chunk
        allowed = pos[None, :] < ((block + 1) * chunk)[:, None]
        if left_chunks >= 0:
            allowed &= pos[None, :] >= (torch.clamp(block - left_chunks, min=0) * chunk)[:, None]
        allowed = valid & allowed[None]
    else:
        allowed = valid.expand(-1, length, -1)
    return allowed | ~allowed.any(-1, keepdim=True)


class CausalConv1d(nn.Conv1d):
    """A stride-1 convolution padded on the left only: output frame ``i`` sees inputs up to ``i``."""

    def __init__(self, channels_in: int, channels_out: int, kernel_size: int):
        super().__init__(channels_in, channels_out, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ConvNormMish(nn.Module):
    """Masked kernel-3 convolution, normalisation, Mish. Non-causal: centred convolution and
    GroupNorm(8) over the whole sequence; causal: left-padded convolution and LayerNorm per frame."""

    def __init__(self, channels_in: int, channels_out: int, causal: bool):
        super().__init__()
        self.causal = causal
        self.conv = CausalConv1d(channels_in, channels_out, 3) if causal else nn.Conv1d(channels_in, channels_out, 3,
                                                                                      padding=1)
        self.norm = nn.LayerNorm(channels_out) if causal else nn.GroupNorm(8, channels_out)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.conv(x * mask)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2) if self.causal else self.norm(h)
        return F.mish(h) * mask


class ResnetBlock(nn.Module):
    """Two ``ConvNormMish`` with the time embedding's projection added between them, plus a
    1x1 residual projection."""

    def __init__(self, channels_in: int, channels_out: int, time_dim: int, causal: bool):
        super().__init__()
        self.time_proj = nn.Linear(time_dim, channels_out)
        self.block1 = ConvNormMish(channels_in, channels_out, causal)
        self.block2 = ConvNormMish(channels_out, channels_out, causal)
        self.res_conv = nn.Conv1d(channels_in, channels_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.time_proj(F.mish(time))[:, :, None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.to_out(out.transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention then a GELU feed-forward (4x wide), each with a residual."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff_in = nn.Linear(dim, 4 * dim)
        self.ff_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), allowed)
        return x + self.ff_out(F.gelu(self.ff_in(self.norm2(x))))


class Level(nn.Module):
    """One U-Net level: a ResNet block, transformer blocks over frames, and a resampling
    convolution (absent in the middle levels)."""

    def __init__(self, channels_in: int, channels_out: int, config: EstimatorConfig, resample: nn.Module | None):
        super().__init__()
        self.resnet = ResnetBlock(channels_in, channels_out, config.time_dim, config.causal)
        self.transformers = nn.ModuleList(TransformerBlock(channels_out, config.num_heads, config.head_dim)
                                          for _ in range(config.blocks_per_level))
        self.resample = resample

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        h = self.resnet(x, mask, time).transpose(1, 2)
        for block in self.transformers:
            h = block(h, allowed)
        return h.transpose(1, 2)


class FlowEstimator(nn.Module):
    """``forward(x, mask, cond_stack, t)``: the flow velocity ``[B, mel, T]`` of noisy mel ``x``
    ``[B, mel, T]`` at flow time ``t`` [B] (0 noise, 1 data), given the conditioning stack
    ``[B, cond_channels, T]`` (see ``conditioning``) and the frame mask ``[B, 1, T]``."""

    def __init__(self, config: EstimatorConfig = EstimatorConfig()):
        super().__init__()
        self.config = config
        c = config

        def same_length_conv(ch: int) -> nn.Module:
            return CausalConv1d(ch, ch, 3) if c.causal else nn.Conv1d(ch, ch, 3, padding=1)

        self.time_in = nn.Linear(c.in_channels, c.time_dim)
        self.time_out = nn.Linear(c.time_dim, c.time_dim)
        if c.meanflow:
            self.time_embed_mixer = nn.Linear(2 * c.time_dim, c.time_dim, bias=False)
        widths = (c.in_channels, *c.channels)
        self.down = nn.ModuleList(
            Level(widths[i], widths[i + 1], c,
                  same_length_conv(widths[i + 1]) if i == len(c.channels) - 1
                  else nn.Conv1d(widths[i + 1], widths[i + 1], 3, stride=2, padding=1))
            for i in range(len(c.channels)))
        self.mid = nn.ModuleList(Level(c.channels[-1], c.channels[-1], c, None) for _ in range(c.mid_levels))
        rev = (*c.channels[::-1], c.channels[0])
        self.up = nn.ModuleList(
            Level(2 * rev[i], rev[i + 1], c,
                  same_length_conv(rev[i + 1]) if i == len(c.channels) - 1
                  else nn.ConvTranspose1d(rev[i + 1], rev[i + 1], 4, stride=2, padding=1))
            for i in range(len(c.channels)))
        self.final_block = ConvNormMish(c.channels[0], c.channels[0], c.causal)
        self.final_proj = nn.Conv1d(c.channels[0], c.mel_channels, 1)

    @staticmethod
    def conditioning(mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The conditioning stack ``[B, 3 * mel, T]`` of encoder output ``mu`` ``[B, mel, T]``,
        projected speaker embedding ``spks`` ``[B, mel]`` and prompt mel ``cond`` ``[B, mel, T]``."""
        return torch.cat([mu, spks[:, :, None].expand(-1, -1, mu.shape[-1]), cond], dim=1)

    def _time(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_out(F.silu(self.time_in(timestep_features(t, self.config.in_channels))))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor, t: torch.Tensor,
                streaming: bool = False, r: torch.Tensor | None = None) -> torch.Tensor:
        """``r`` [B]: the step's end time, read by a ``meanflow`` estimator only (and required there)."""
        c = self.config
        time = self._time(t)
        if c.meanflow:
            if r is None:
                raise ValueError("a meanflow estimator needs the step's end time r")
            time = self.time_embed_mixer(torch.cat([time, self._time(r)], dim=1))
        chunk = c.static_chunk_size if (streaming and c.causal) else 0

        def allowed(m: torch.Tensor) -> torch.Tensor:
            return chunk_attention_mask(m, chunk, c.left_chunks if chunk else -1)

        h = torch.cat([x, cond_stack], dim=1)
        skips, masks = [], [mask]
        for level in self.down:
            m = masks[-1]
            h = level(h, m, time, allowed(m))
            skips.append(h)
            h = level.resample(h * m)
            masks.append(m[:, :, ::2])
        m = masks[-2]
        attend = allowed(m)
        for level in self.mid:
            h = level(h, m, time, attend)
        for level, m in zip(self.up, masks[-2::-1]):
            skip = skips.pop()
            h = level(torch.cat([h[:, :, :skip.shape[-1]], skip], dim=1), m, time, allowed(m))
            h = level.resample(h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask


# The released names (CosyVoice's ConditionalDecoder, matcha's blocks, diffusers' attention) -> ours.
_RENAMES = [
    (r"^time_mlp\.linear_1\.", "time_in."),
    (r"^time_mlp\.linear_2\.", "time_out."),
    (r"^down_blocks\.", "down."),
    (r"^mid_blocks\.", "mid."),
    (r"^up_blocks\.", "up."),
    (r"^(down|mid|up)\.(\d+)\.0\.", r"\1.\2.resnet."),
    (r"^(down|mid|up)\.(\d+)\.1\.", r"\1.\2.transformers."),
    (r"^(down|up)\.(\d+)\.2\.(conv\.)?", r"\1.\2.resample."),
    (r"\.mlp\.1\.", ".time_proj."),
    (r"(block1|block2|final_block)\.block\.0\.", r"\1.conv."),
    (r"(block1|block2|final_block)\.block\.[12]\.", r"\1.norm."),
    (r"\.attn1\.to_out\.0\.", ".attn.to_out."),
    (r"\.attn1\.", ".attn."),
    (r"\.norm3\.", ".norm2."),
    (r"\.ff\.net\.0\.proj\.", ".ff_in."),
    (r"\.ff\.net\.2\.", ".ff_out."),
]


def estimator_name_map(name: str, prefix: str = "decoder.estimator.") -> str | None:
    """A released flow checkpoint's name as ``FlowEstimator`` calls it, or None for names
    outside ``prefix`` (the rest of the flow module). The prefix is ``"decoder.estimator."``
    in CosyVoice2's ``flow.pt`` and ``"flow.decoder.estimator."`` in Chatterbox's S3Gen."""
    if not name.startswith(prefix):
        return None
    name = name[len(prefix):]
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name
