"""Fish S2-Pro's codec decoder: codes to 44.1 kHz audio, causal, and streamable.

The codec is fish-speech's modded DAC. A frame of ``N`` codes (one semantic code from a
4096-entry book, ``N - 1`` residual codes from 1024-entry books) becomes audio this way:

* ``quantizer``: each code's 8-dim codebook vector through its book's 1x1 ``out_proj``,
  summed over the books (``latent_dim`` channels, one step per frame); ``post_module``, a
  causal transformer whose attention sees the last ``window_size`` frames (RoPE on
  interleaved pairs, layer scales, RMS norms); then ``upsample``: per factor a transposed
  conv (kernel = stride) and a ConvNeXt block, 4x in all.
* ``decoder``: a causal conv, four blocks (Snake, a causal transposed conv of kernel
  ``2 * stride``, three residual units with dilations 1, 3, 9), Snake, a causal conv, tanh:
  ``prod(decoder_rates)`` samples a step, 2048 samples a frame at the release's rates.

Every layer is causal, so the decoder streams: ``step(codes, state)`` decodes only the new
frames against a per-stream ``CodecState`` (each conv's last inputs, each transposed conv's
overlapping tail, each attention layer's last ``window_size - 1`` keys and values), and a
stream of steps equals the whole decode of its frames. ``decode`` is one step from a fresh
state. Parameter names are the released ones with weight norm folded into ``weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CodecConfig:
    """The release's ``modded_dac_vq.yaml`` values by default."""

    sample_rate: int = 44100
    latent_dim: int = 1024
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    semantic_codebook_size: int = 4096
    codebook_size: int = 1024
    n_codebooks: int = 9  # residual books; a frame has 1 + n_codebooks codes
    codebook_dim: int = 8
    downsample_factor: tuple[int, ...] = (2, 2)
    n_layer: int = 8  # post_module
    n_head: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    window_size: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.decoder_rates) * math.prod(self.downsample_factor)


@dataclass(frozen=True)
class WindowSpec:
    """A causal window transformer's sizes (the quantizer's ``post_module`` and
    ``pre_module``, the encoder's last block)."""

    dim: int
    n_layer: int
    n_head: int
    head_dim: int
    intermediate_size: int
    window_size: int
    rope_base: float
    norm_eps: float


def post_spec(c: CodecConfig) -> WindowSpec:
    return WindowSpec(c.latent_dim, c.n_layer, c.n_head, c.head_dim, c.intermediate_size, c.window_size,
                      c.rope_base, c.norm_eps)


@dataclass
class CodecState:
    """One stream's decoder state; fresh (empty) at the stream's start."""

    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    frames: int = 0  # frames decoded so far: the next frame's position


def _step(module: nn.Module, x: torch.Tensor, state: CodecState) -> torch.Tensor:
    step = getattr(module, "step", None)
    return step(x, state) if step is not None else module(x)


class StreamSequential(nn.Sequential):
    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        for module in self:
            x = _step(module, x, state)
        return x


class CausalConv(nn.Module):
    """Conv1d (stride 1) padded on the left by its reach; streamed, the padding is the last
    ``(kernel - 1) * dilation`` inputs of the stream."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.reach = (kernel - 1) * dilation

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        if self.reach == 0:
            return self.conv(x)
        past = state.tensors.get(id(self))
        if past is None:
            past = x.new_zeros(*x.shape[:2], self.reach)
        x = torch.cat((past, x), dim=-1)
        state.tensors[id(self)] = x[..., -self.reach:]
        return self.conv(x)


class CausalTransConv(nn.Module):
    """ConvTranspose1d whose output is cut to ``stride`` samples per input step; streamed, the
    ``kernel - stride`` samples that spill past a chunk are added to the next one's start."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride, self.spill = stride, kernel - stride

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        y = F.conv_transpose1d(x, self.conv.weight, None, self.stride)
        length = x.shape[-1] * self.stride
        if self.spill:
            tail = state.tensors.get(id(self))
            if tail is not None:
                y = torch.cat((y[..., :self.spill] + tail, y[..., self.spill:]), dim=-1)
            state.tensors[id(self)] = y[..., length:]
        return y[..., :length] + self.conv.bias[:, None]


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = StreamSequential(Snake1d(dim), CausalConv(dim, dim, 7, dilation), Snake1d(dim),
                                      CausalConv(dim, dim, 1))

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        return x + self.block.step(x, state)


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.block = StreamSequential(Snake1d(cin), CausalTransConv(cin, cout, 2 * stride, stride),
                                      *(ResidualUnit(cout, d) for d in (1, 3, 9)))

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        return self.block.step(x, state)


class Decoder(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        width = config.decoder_dim
        layers: list[nn.Module] = [CausalConv(config.latent_dim, width, 7)]
        for i, stride in enumerate(config.decoder_rates):
            layers.append(DecoderBlock(width // 2**i, width // 2 ** (i + 1), stride))
        out = width // 2 ** len(config.decoder_rates)
        layers += [Snake1d(out), CausalConv(out, 1, 7), nn.Tanh()]
        self.model = StreamSequential(*layers)

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        return self.model.step(x, state)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        y = self.dwconv.step(x, state).transpose(1, 2)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).transpose(1, 2)


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE on channel pairs ``(2j, 2j + 1)`` of ``x [B, T, H, D]`` at ``positions [T]``."""
    dim = x.shape[-1]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, device=x.device).float() / dim))
    angles = positions.float()[:, None] * freqs
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class WindowAttention(nn.Module):
    """Causal attention over the last ``window`` positions; streamed, the last ``window - 1``
    rotated keys and values of the stream are kept."""

    def __init__(self, config: WindowSpec) -> None:
        super().__init__()
        self.config = config
        inner = config.n_head * config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * inner, bias=False)
        self.wo = nn.Linear(inner, config.dim, bias=False)

    def step(self, x: torch.Tensor, positions: torch.Tensor, state: CodecState) -> torch.Tensor:
        c = self.config
        batch, length, _ = x.shape
        q, k, v = self.wqkv(x).view(batch, length, 3, c.n_head, c.head_dim).unbind(2)
        q, k = rotate_pairs(q, positions, c.rope_base), rotate_pairs(k, positions, c.rope_base)
        past = state.tensors.get(id(self))
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
        keep = c.window_size - 1
        state.tensors[id(self)] = torch.stack((k[:, -keep:], v[:, -keep:])) if keep else k.new_zeros(2, batch, 0)
        key_pos = torch.arange(positions[-1] + 1 - k.shape[1], positions[-1] + 1, device=x.device)
        gap = positions[:, None] - key_pos[None]
        allowed = (gap >= 0) & (gap < c.window_size)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed)
        return self.wo(y.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inner, bias=False)
        self.w3 = nn.Linear(dim, inner, bias=False)
        self.w2 = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: WindowSpec) -> None:
        super().__init__()
        self.attention = WindowAttention(config)
        self.feed_forward = FeedForward(config.dim, config.intermediate_size)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_layer_scale = LayerScale(config.dim)
        self.ffn_layer_scale = LayerScale(config.dim)

    def step(self, x: torch.Tensor, positions: torch.Tensor, state: CodecState) -> torch.Tensor:
        h = x + self.attention_layer_scale(self.attention.step(self.attention_norm(x), positions, state))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowTransformer(nn.Module):
    """A causal window transformer, channels first in and out."""

    def __init__(self, config: WindowSpec) -> None:
        super().__init__()
        if config.n_head * config.head_dim != config.dim:
            raise NotImplementedError("window transformer: n_head * head_dim must equal its width")
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        positions = torch.arange(state.frames, state.frames + x.shape[-1], device=x.device)
        x = x.transpose(1, 2)
        for layer in self.layers:
            x = layer.step(x, positions, state)
        return self.norm(x).transpose(1, 2)


class CodeBook(nn.Module):
    def __init__(self, size: int, dim: int, out: int) -> None:
        super().__init__()
        self.codebook = nn.Embedding(size, dim)
        self.out_proj = nn.Conv1d(dim, out, 1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class BookSet(nn.Module):
    def __init__(self, count: int, size: int, dim: int, out: int) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(CodeBook(size, dim, out) for _ in range(count))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return sum(book(codes[:, i]) for i, book in enumerate(self.quantizers))  # type: ignore[return-value]


class Quantizer(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        c = config
        self.semantic_quantizer = BookSet(1, c.semantic_codebook_size, c.codebook_dim, c.latent_dim)
        self.quantizer = BookSet(c.n_codebooks, c.codebook_size, c.codebook_dim, c.latent_dim)
        self.post_module = WindowTransformer(post_spec(c))
        self.upsample = StreamSequential(*(StreamSequential(CausalTransConv(c.latent_dim, c.latent_dim, f, f),
                                                            ConvNeXtBlock(c.latent_dim))
                                           for f in reversed(c.downsample_factor)))
        self.config = c

    def step(self, codes: torch.Tensor, state: CodecState) -> torch.Tensor:
        c = self.config
        z = (self.semantic_quantizer(codes[:, :1].clamp(0, c.semantic_codebook_size - 1))
             + self.quantizer(codes[:, 1:].clamp(0, c.codebook_size - 1)))
        return self.upsample.step(self.post_module.step(z, state), state)


class CodecDecoder(nn.Module):
    """Codes ``[B, 1 + n_codebooks, T]`` to audio ``[B, T * samples_per_frame]``."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = Quantizer(config)
        self.decoder = Decoder(config)

    def step(self, codes: torch.Tensor, state: CodecState) -> torch.Tensor:
        """The audio of the new frames ``codes``, continuing the stream ``state`` (updated)."""
        audio = self.decoder.step(self.quantizer.step(codes, state), state)[:, 0]
        state.frames += codes.shape[-1]
        return audio

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.step(codes, CodecState())
