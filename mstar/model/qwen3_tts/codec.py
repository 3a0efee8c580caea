"""The 12 Hz speech tokenizer's decoder: ``Q`` codebooks per frame to 24 kHz audio.

Per frame: the codes are dequantised (a split residual quantizer: codebook 0 alone, 1 .. Q - 1
summed, each group projected by a 1x1 conv), a causal kernel-3 conv and ``input_proj`` bring
them to the transformer (layers of sliding-window causal attention, ``sliding_window`` frames,
and SwiGLU, each branch under a ``LayerScale``), ``output_proj`` back to the latent width, then
the **conv stack**: upsampling stages (a transposed conv of kernel = stride and a ConvNeXt
block) and a DAC-style decoder (causal conv, blocks of SnakeBeta + transposed conv of kernel
``2r`` trimmed by ``r`` on the right + dilated residual units, SnakeBeta, causal conv to one
channel), clamped to ``[-1, 1]``. Every conv is causal and every transposed conv keeps
``stride`` samples per input step, so ``T`` frames give exactly ``T * samples_per_frame``
samples and a sample never depends on a later frame.

Streaming (``decode_window``) exploits that: a window of ``context + new`` frames runs the
transformer over all of them (its attention needs the context), but the conv stack, nearly
all of the decoder's time, only over the new frames plus its receptive field
(``conv_reach`` frames, derived from the modules: 10 for the released decoder); their audio
equals the whole window's.

Parameter names are the tokenizer's ``decoder.`` keys less that prefix; the encoder's keys and
the quantizer's ``input_proj`` (used only to encode) are not loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.norm import RMSNorm
from mstar.layers.rotary import RotaryEmbedding
from mstar.model.ltx2_5.vocoder import Snake
from mstar.model.qwen3_omni.code2wav import CausalConv1d, ConvNeXtBlock, ResidualUnit, TransformerLayer
from mstar.model.qwen3_tts.config import CodecConfig


class Codebook(nn.Module):
    """A codebook kept as running sums (``embedding_sum / cluster_usage``), the released form."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        table = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        return F.embedding(codes, table)


class CodebookSlot(nn.Module):
    """One quantizer level (``vq.layers.i._codebook``)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class Levels(nn.Module):
    def __init__(self, levels: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CodebookSlot(size, dim) for _ in range(levels))


class ResidualQuantizer(nn.Module):
    """Levels summed, then ``output_proj`` (1x1 conv, no bias): ``[B, L, T]`` to ``[B, C, T]``."""

    def __init__(self, levels: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = Levels(levels, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        total = sum(slot._codebook(codes[:, i]) for i, slot in enumerate(self.vq.layers))
        return self.output_proj(total.transpose(1, 2))


class SplitQuantizer(nn.Module):
    """Codebook 0 (semantic) and 1 .. Q - 1 (acoustic), each group with its own projection."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        dim = config.codebook_dim // 2
        self.rvq_first = ResidualQuantizer(1, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = ResidualQuantizer(config.num_quantizers - 1, config.codebook_size, dim, config.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class DecoderTransformer(nn.Module):
    """``input_proj``, sliding-window causal layers, the final norm, ``output_proj``."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.window = config.sliding_window
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, latent]`` to ``[B, T, latent]``; positions count from the window's start."""
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        back = positions[:, None] - positions[None, :]  # how far key j lies behind query i
        allowed = (back >= 0) & (back < self.window)
        x = self.input_proj(x)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return self.output_proj(self.norm(x))


class RightTrimmedConvTranspose1d(nn.Module):
    """A transposed conv (``stride`` samples per input step) with its ``kernel - stride``
    overhanging samples cut on the right: causal, ``T`` steps give ``T * stride`` samples."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels_in, channels_out, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., : x.shape[-1] - self.trim] if self.trim else x


class DecoderBlock(nn.Module):
    """SnakeBeta, a ``rate``-fold transposed conv halving the channels, residual units of
    dilations 1, 3, 9 (``block.0 .. block.4``)."""

    def __init__(self, dim_in: int, rate: int) -> None:
        super().__init__()
        dim = dim_in // 2
        self.block = nn.ModuleList([Snake(dim_in, use_beta=True),
                                    RightTrimmedConvTranspose1d(dim_in, dim, 2 * rate, rate),
                                    *(ResidualUnit(dim, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


def conv_reach(stages: Sequence[nn.Module]) -> int:
    """How many earlier frames a sample of ``stages`` (run in order on frame-rate input) may
    depend on: each causal conv's reach and each transposed conv's overhang, in its own
    samples, over the samples per frame at that point, summed and rounded up."""
    frames, rate = 0.0, 1
    for module in (m for stage in stages for m in stage.modules()):
        if isinstance(module, CausalConv1d):
            frames += module.reach / rate
        elif isinstance(module, RightTrimmedConvTranspose1d):
            stride = module.conv.stride[0]
            frames += math.ceil(module.trim / stride) / rate
            rate *= stride
    return math.ceil(frames)


class Qwen3TTSCodec(nn.Module):
    """Codes ``[B, Q, T]`` to waveforms ``[B, T * samples_per_frame]`` in ``[-1, 1]``."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = SplitQuantizer(config)
        self.pre_conv = CausalConv1d(config.codebook_dim, config.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(config)
        self.upsample = nn.ModuleList(
            nn.ModuleList([RightTrimmedConvTranspose1d(config.latent_dim, config.latent_dim, r, r),
                           ConvNeXtBlock(config.latent_dim)])
            for r in config.upsampling_ratios)
        blocks: list[nn.Module] = [CausalConv1d(config.latent_dim, config.decoder_dim, 7)]
        blocks += [DecoderBlock(config.decoder_dim // 2**i, r) for i, r in enumerate(config.upsample_rates)]
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        blocks += [Snake(out_dim, use_beta=True), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(blocks)
        self.conv_reach = conv_reach([*self.upsample, *self.decoder])

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q, T]`` codes to the conv stack's input ``[B, latent, T]``."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, Q, T] with Q = {self.config.num_quantizers}, "
                             f"got {tuple(codes.shape)}")
        x = self.pre_conv(self.quantizer(codes)).transpose(1, 2)
        return self.pre_transformer(x).transpose(1, 2)

    def conv_stack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, latent, T]`` to ``[B, T * samples_per_frame]``."""
        for stage in self.upsample:
            for layer in stage:
                x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x.squeeze(1).clamp(-1.0, 1.0)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.conv_stack(self.latents(codes))

    def decode_window(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """The audio of a window's new frames: ``codes [B, Q, context + new]``, of which the
        first ``context`` frames are left context already spoken. The transformer runs over
        the whole window, the conv stack over the new frames and ``conv_reach`` frames before
        them; equal to ``forward(codes)`` less the context's samples."""
        frames = codes.shape[-1]
        if not 0 <= context < frames:
            raise ValueError(f"context {context} must leave at least one new frame of {frames}")
        latents = self.latents(codes)
        lead = min(self.conv_reach, context)
        wav = self.conv_stack(latents[..., context - lead:])
        return wav[..., lead * self.samples_per_frame:]

    def decode_rows(self, codes: torch.Tensor, starts: torch.Tensor, frames: int) -> torch.Tensor:
        """Windows of different lengths and contexts as one batch: ``codes [B, Q, L]``, each row a
        window left-aligned and padded on the right to ``L``; row ``b``'s conv stack runs over
        ``frames`` latents from ``starts[b]`` (its lead frames, then its new ones, then padding).
        Every layer is causal, so padding after a row's frames never reaches their samples: the
        caller keeps each row's own span of the ``[B, frames * samples_per_frame]`` result."""
        latents = self.latents(codes)
        index = (starts[:, None] + torch.arange(frames, device=codes.device)).clamp(max=codes.shape[-1] - 1)
        return self.conv_stack(latents.gather(2, index[:, None, :].expand(-1, latents.shape[1], -1)))

    def decode_stream(self, codes: torch.Tensor, ramp: Sequence[int] = (1, 3, 8, 16, 25),
                      left_context: int = 72, prefix: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """A whole clip's audio window by window, as a stream decodes it: ``stream_windows``;
        ``prefix [B, Q, P]``: frames before the stream, context only (``with_prefix``)."""
        for start, context, new in stream_windows(codes.shape[-1], ramp, left_context):
            window = codes[..., start - context: start + new]
            if prefix is not None:
                window, context = with_prefix(window, context, prefix, left_context)
            yield self.decode_window(window, context)

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context: int = 25) -> torch.Tensor:
        """The reference tokenizer's offline decode: fixed chunks behind up to ``left_context``
        frames of context, joined."""
        out, frames = [], codes.shape[-1]
        for start in range(0, frames, chunk_size):
            context = min(left_context, start)
            out.append(self.decode_window(codes[..., start - context: start + chunk_size], context))
        return torch.cat(out, dim=-1)


def with_prefix(window: torch.Tensor, context: int, prefix: torch.Tensor, left_context: int
                ) -> tuple[torch.Tensor, int]:
    """A window ``[..., Q, context + new]`` whose context falls short of ``left_context``
    topped up from the end of ``prefix [..., Q, P]`` (frames decoded before the stream's first,
    never spoken: in-context cloning's clip, as the reference decodes ``[clip, new frames]``
    and cuts the clip's samples); returns the window and its context."""
    extra = min(left_context - context, prefix.shape[-1])
    if extra <= 0:
        return window, context
    return torch.cat([prefix[..., prefix.shape[-1] - extra:].to(window.dtype), window], dim=-1), context + extra


def stream_windows(frames: int, ramp: Sequence[int] = (1, 3, 8, 16, 25),
                   left_context: int = 72) -> list[tuple[int, int, int]]:
    """The windows a stream of ``frames`` codec frames is decoded in: ``(start, context, new)``,
    the new frames ``[start, start + new)`` behind ``context`` frames already decoded. New
    frames follow ``ramp`` (the last size repeats; the final window takes what is left), the
    context is up to ``left_context`` frames (the decoder transformer's sliding window)."""
    if not ramp or min(ramp) < 1 or left_context < 0:
        raise ValueError("ramp sizes must be positive and left_context non-negative")
    windows, start, index = [], 0, 0
    while start < frames:
        new = min(ramp[min(index, len(ramp) - 1)], frames - start)
        windows.append((start, min(left_context, start), new))
        start, index = start + new, index + 1
    return windows
