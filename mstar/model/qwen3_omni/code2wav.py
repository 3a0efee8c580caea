"""Qwen3-Omni's codec decoder (code2wav): the talker's codes in, a waveform out.

A frame of codes is ``num_quantizers`` codebook indices (16 released, 12.5 frames a second).
Each quantizer has its own table inside one embedding (quantizer ``q``'s rows start at
``q * codebook_size``); a frame's embedding is the mean of its quantizers' rows. A small
pre-norm transformer (8 layers released) runs over the frames with causal attention inside a
window of ``sliding_window`` frames (the frame itself and the ``sliding_window - 1`` before
it), rotary positions from frame 0, a SwiGLU MLP, and a learned per-channel scale on each
residual branch ("layer scale"). Then the frames are upsampled in time: per
``upsampling_ratios`` a transposed convolution (kernel = stride = ratio) and a ConvNeXt block
(depthwise causal kernel-7 conv, LayerNorm, 4x MLP with GELU, scaled by ``gamma``); then the
decoder: a causal kernel-7 conv to ``decoder_dim`` channels, per ``upsample_rates`` a block
(SnakeBeta, a transposed conv of kernel ``2r`` and stride ``r`` trimmed by ``r`` on both sides,
so ``T`` frames become ``(T - 1) r`` samples, then three residual units of dilations 1, 3, 9),
a last SnakeBeta and a causal kernel-7 conv to one channel, clamped to ``[-1, 1]``.

Every convolution looks only back, and attention only back, so a chunk decoded with enough
left context reproduces the whole clip's samples; ``decode_chunks`` cuts a clip the way the
reference's ``chunked_decode`` does (chunks of ``chunk_size`` frames, each decoded with up to
``left_context`` frames before it whose samples are dropped), and yields each chunk's samples
as it is done. The released rates make ``samples_per_frame`` 1920 (24 kHz at 12.5 Hz).

Parameter names are the released checkpoint's ``code2wav.`` keys, less the prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.mlp import SwiGLU
from mstar.layers.norm import RMSNorm
from mstar.layers.rotary import RotaryEmbedding, apply_rotary
from mstar.model.hf_config import config_kwargs
from mstar.model.ltx2_5.vocoder import Snake


@dataclass
class Qwen3OmniCode2WavConfig:
    """The codec decoder's hyper-parameters; names follow ``code2wav_config`` of ``config.json``."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    attention_bias: bool = False
    sliding_window: int = 72
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8000
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])  # transformer frames -> decoder frames
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])  # the decoder's blocks
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must split into num_attention_heads, a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.upsample_rates)} times")
        self.upsampling_ratios = list(self.upsampling_ratios)
        self.upsample_rates = list(self.upsample_rates)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per code frame (the product of every upsampling factor)."""
        return math.prod(self.upsampling_ratios + self.upsample_rates)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniCode2WavConfig:
        """From a whole Omni ``config.json`` dict (``code2wav_config``) or the code2wav part."""
        d = d.get("code2wav_config", d)
        kwargs = config_kwargs(cls, d, nullable=set())
        rope = kwargs.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"rope_type {rope.get('rope_type')!r} is not supported")
        kwargs["rope_scaling"] = None
        return cls(**kwargs)


class CausalConv1d(nn.Module):
    """A stride-1 convolution padded on the left by its reach, ``(kernel - 1) * dilation``: output
    ``i`` sees inputs up to ``i``, and the length is kept. The conv is ``conv`` (the released
    names)."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels_in, channels_out, kernel, dilation=dilation, groups=groups)
        self.reach = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.reach, 0)))


class TrimmedConvTranspose1d(nn.Module):
    """A transposed convolution (``stride`` times the frames) with ``kernel - stride`` samples cut
    from each end, as the reference does: ``T`` frames give ``T * stride - (kernel - stride)``."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels_in, channels_out, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim: x.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    """``x + gamma * pwconv2(gelu(pwconv1(norm(dwconv(x)))))`` over ``[B, C, T]``; the depthwise
    conv is causal (kernel 7), the rest acts on each frame."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).transpose(1, 2)
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + y.transpose(1, 2)


class LayerScale(nn.Module):
    """A learned per-channel factor on a residual branch (``scale``)."""

    def __init__(self, dim: int, initial: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class WindowAttention(nn.Module):
    """Causal self-attention over ``[B, T, H]`` frames within a band (``window`` frames, the
    current one included), rotary positions given as tables. ``allowed`` is the band's mask
    (None: plain causal attention, as the 12 Hz codec's encoder has)."""

    def __init__(self, config: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = nn.Linear(config.hidden_size, heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class TransformerLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each branch scaled by a ``LayerScale``."""

    def __init__(self, config: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = WindowAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, allowed))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """The frames' transformer: ``[B, T, H]`` embeddings in, normed states out."""

    def __init__(self, config: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.window = config.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        back = positions[:, None] - positions[None, :]  # how far key j lies behind query i
        allowed = (back >= 0) & (back < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed)
        return self.norm(x)


class ResidualUnit(nn.Module):
    """``x + conv2(snake(conv1(snake(x))))``: a dilated causal kernel-7 conv, then a 1x1 conv."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = Snake(dim, use_beta=True)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = Snake(dim, use_beta=True)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, a ``rate``-fold upsampling transposed conv halving the channels, and residual
    units of dilations 1, 3, 9 (``block.0 .. block.4``, the released names)."""

    def __init__(self, dim_in: int, rate: int) -> None:
        super().__init__()
        dim = dim_in // 2
        self.block = nn.Sequential(Snake(dim_in, use_beta=True), TrimmedConvTranspose1d(dim_in, dim, 2 * rate, rate),
                                   *(ResidualUnit(dim, d) for d in (1, 3, 9)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Qwen3OmniCode2Wav(nn.Module):
    """Codes ``[Q, T]`` (or ``[B, Q, T]``) to a waveform ``[N]`` (or ``[B, N]``) in ``[-1, 1]``.

    ``N`` is a little under ``T * samples_per_frame``: decoder block ``i``'s trimmed transposed
    conv leaves ``r_i`` samples fewer than ``r_i`` times its input, and the blocks after it scale
    that loss (555 samples for the released rates); the reference's lengths, kept."""

    def __init__(self, config: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, hidden)
        self.pre_transformer = PreTransformer(config)
        self.upsample = nn.ModuleList(
            nn.Sequential(TrimmedConvTranspose1d(hidden, hidden, r, r), ConvNeXtBlock(hidden))
            for r in config.upsampling_ratios)
        blocks: list[nn.Module] = [CausalConv1d(hidden, config.decoder_dim, 7)]
        blocks += [DecoderBlock(config.decoder_dim // 2**i, r) for i, r in enumerate(config.upsample_rates)]
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        blocks += [Snake(out_dim, use_beta=True), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.Sequential(*blocks)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q, T]`` codes to ``[B, T, H]``: each quantizer's row from its own table, averaged."""
        offsets = torch.arange(codes.shape[1], device=codes.device)[:, None] * self.config.codebook_size
        return self.code_embedding(codes + offsets).mean(dim=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        single = codes.dim() == 2
        codes = codes[None] if single else codes
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [Q, T] or [B, Q, T] with Q = {self.config.num_quantizers}, "
                             f"got {tuple(codes.shape)}")
        x = self.pre_transformer(self.embed(codes)).transpose(1, 2)
        for stage in self.upsample:
            x = stage(x)
        wav = self.decoder(x).squeeze(1).clamp(-1.0, 1.0)
        return wav[0] if single else wav

    def decode_chunks(self, codes: torch.Tensor, chunk_size: int = 300,
                      left_context: int = 25) -> Iterator[torch.Tensor]:
        """The clip's samples chunk by chunk, as the reference's ``chunked_decode`` makes them:
        frames ``[s, s + chunk_size)`` are decoded after up to ``left_context`` earlier frames,
        whose ``samples_per_frame`` samples each are dropped. The chunks' concatenation is
        ``chunked_decode``'s output (not ``forward``'s: a context shorter than the window and
        the decoder's reach, and the trimmed ends, change the samples near each cut)."""
        if chunk_size < 1 or left_context < 0:
            raise ValueError("chunk_size must be positive and left_context non-negative")
        frames = codes.shape[-1]
        for start in range(0, frames, chunk_size):
            context = min(left_context, start)
            wav = self(codes[..., start - context: start + chunk_size])
            yield wav[..., context * self.config.samples_per_frame:]

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context: int = 25) -> torch.Tensor:
        """``decode_chunks`` joined: the whole clip's waveform."""
        return torch.cat(list(self.decode_chunks(codes, chunk_size, left_context)), dim=-1)
