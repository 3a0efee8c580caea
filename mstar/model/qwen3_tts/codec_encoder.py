"""The 12 Hz speech tokenizer's encoder: 24 kHz audio to ``Q`` codes per 12.5 Hz frame.

The released encoder is a Mimi encoder (``encoder_config`` of the tokenizer's ``config.json``,
a ``MimiConfig``), of which the tokenizer keeps the first ``encoder_valid_num_quantizers``
codebooks. In order:

* **SEANet conv stack** (``encoder.layers``): a conv from the waveform to ``num_filters``
  channels, then per ratio of ``reversed(upsampling_ratios)`` residual blocks (ELU, a dilated
  kernel-3 conv to half the channels, ELU, a 1x1 conv back, added to the input) and ELU + a
  strided conv of kernel ``2r`` doubling the channels; ELU and a last conv to ``hidden_size``.
  Every conv is causal: ``kernel - stride`` zeros on the left, and on the right whatever
  brings the length to a multiple of the stride.
* **transformer** (``encoder_transformer``): LayerNorm (with bias) pre-norm layers of causal
  rotary attention and a GELU MLP, each branch under a ``LayerScale``; no final norm. The
  reference builds a plain causal mask (Mimi's ``sliding_window`` is not applied), so neither
  is it here.
* **downsample**: a causal conv of kernel 4, stride 2, no bias, padded by *replicating* the
  edge samples (from 25 to 12.5 Hz for the released rates).
* **split RVQ**: codebook 0 from the semantic quantizer, codebooks 1 .. Q - 1 from the
  acoustic one, each projecting the latents (``input_proj``, 1x1 conv) and taking the nearest
  codeword (Euclidean) of the residual level by level.

A clip of ``n`` samples gives ``ceil(n / encode_downsample_rate)`` frames (the reference
trims the encoder's output to that). Parameter names are the tokenizer's ``encoder.`` keys
less that prefix; the quantizers' ``output_proj``, the ``initialized`` flags and the levels
past the kept codebooks (used only to decode with Mimi's own decoder) are not loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.rotary import RotaryEmbedding
from mstar.model.hf_config import config_kwargs
from mstar.model.qwen3_omni.code2wav import LayerScale, WindowAttention


@dataclass
class EncoderConfig:
    """The encoder's part of the tokenizer's ``config.json`` (``encoder_config`` and the
    tokenizer's ``encoder_valid_num_quantizers`` / ``encode_downsample_rate``); defaults are
    ``MimiConfig``'s and the tokenizer's."""

    sampling_rate: int = 24000
    frame_rate: float | None = None
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: list[int] = field(default_factory=lambda: [8, 6, 5, 4])
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    valid_quantizers: int = 16
    samples_per_frame: int = 1920

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.use_causal_conv or self.audio_channels != 1:
            raise NotImplementedError("only the causal mono encoder (the released one) is supported")
        if self.hidden_act != "gelu" or self.pad_mode not in ("constant", "replicate"):
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} / pad_mode {self.pad_mode!r} not supported")
        if not self.num_semantic_quantizers <= self.valid_quantizers <= self.num_quantizers:
            raise ValueError(f"encoder_valid_num_quantizers {self.valid_quantizers} must lie between "
                             f"num_semantic_quantizers and num_quantizers {self.num_quantizers}")

    @property
    def downsample_kernel(self) -> int:
        """The kernel of the stride-2 downsample from the conv stack's rate to ``frame_rate``
        (Mimi's rule, 4 for the released 25 to 12.5 Hz); 0: the rates agree, no downsample."""
        hop = math.prod(self.upsampling_ratios)
        conv_rate = math.ceil(self.sampling_rate / hop)
        frame_rate = self.frame_rate if self.frame_rate is not None else self.sampling_rate / (2 * hop)  # Mimi's
        return 0 if frame_rate == conv_rate else 2 * int(conv_rate / frame_rate)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> EncoderConfig:
        """From the tokenizer's whole ``config.json`` (unknown keys ignored)."""
        enc = dict(d.get("encoder_config") or {})
        if enc.get("frame_rate") is None and "_frame_rate" in enc:  # how MimiConfig saves it (released)
            enc["frame_rate"] = enc["_frame_rate"]
        enc["valid_quantizers"] = d.get("encoder_valid_num_quantizers", 16)
        enc["samples_per_frame"] = d.get("encode_downsample_rate", 1920)
        kwargs = config_kwargs(cls, enc, {"head_dim", "frame_rate"})
        rope = kwargs.pop("rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"encoder_config.rope_scaling {rope} is not supported")
        return cls(**kwargs)


class CausalConv(nn.Module):
    """Mimi's causal conv (``conv``): ``kernel - stride`` samples of left padding (``pad_mode``),
    right padding to a whole number of strides."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, bias=bias)
        self.stride, self.pad_mode = stride, pad_mode
        self.left = (kernel - 1) * dilation + 1 - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        right = -length % self.stride
        return self.conv(F.pad(x, (self.left, right), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """``x + conv(ELU(conv(ELU(x))))`` (``block.1``, ``block.3``), an optional 1x1 shortcut."""

    def __init__(self, config: EncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([nn.ELU(), CausalConv(dim, hidden, config.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), CausalConv(hidden, dim, 1)])
        self.shortcut = CausalConv(dim, dim, 1) if config.use_conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return self.shortcut(x) + y


class ConvStack(nn.Module):
    """Waveform ``[B, 1, N]`` to ``[B, hidden, ceil(N / hop)]`` (``encoder.layers``)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv(config.audio_channels, config.num_filters, config.kernel_size)]
        channels = config.num_filters
        for ratio in reversed(config.upsampling_ratios):
            layers += [ResnetBlock(config, channels, config.dilation_growth_rate ** j)
                       for j in range(config.num_residual_layers)]
            layers += [nn.ELU(), CausalConv(channels, channels * 2, 2 * ratio, stride=ratio)]
            channels *= 2
        layers += [nn.ELU(), CausalConv(channels, config.hidden_size, config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Mlp(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, eps, s = config.hidden_size, config.norm_eps, config.layer_scale_initial_scale
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)
        self.self_attn, self.mlp = WindowAttention(config), Mlp(config)
        self.self_attn_layer_scale, self.mlp_layer_scale = LayerScale(h, s), LayerScale(h, s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """Causal layers over ``[B, T, hidden]``, positions from 0."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(torch.arange(x.shape[1], device=x.device), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Codebook(nn.Module):
    """Mimi's Euclidean codebook, kept as running sums (buffers ``embed_sum``, ``cluster_usage``)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class Level(nn.Module):
    """One quantizer level (``layers.i.codebook``)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualQuantizer(nn.Module):
    """``input_proj`` (when the codebook width differs), then nearest codewords level by level
    on the residual: ``[B, hidden, T]`` to codes ``[B, levels, T]``."""

    def __init__(self, config: EncoderConfig, levels: int) -> None:
        super().__init__()
        dim = config.vector_quantization_hidden_dimension
        self.input_proj = nn.Conv1d(config.hidden_size, dim, 1, bias=False) if dim != config.hidden_size else None
        self.layers = nn.ModuleList(Level(config.codebook_size, dim) for _ in range(levels))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(latents) if self.input_proj is not None else latents
        residual = x.transpose(1, 2)  # [B, T, D]
        codes = []
        for level in self.layers:
            table = level.codebook.table()
            flat = residual.reshape(-1, residual.shape[-1])
            index = torch.cdist(flat[None].float(), table[None].float(), p=2)[0].argmin(-1).view(residual.shape[:-1])
            residual = residual - F.embedding(index, table)
            codes.append(index)
        return torch.stack(codes, dim=1)


class SplitQuantizer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        semantic = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(config, semantic)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(config, config.valid_quantizers - semantic)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer(latents)
        if len(self.acoustic_residual_vector_quantizer.layers):
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer(latents)], dim=1)
        return codes


class Qwen3TTSCodecEncoder(nn.Module):
    """24 kHz mono audio to the tokenizer's codes ``[T, Q]`` (``encode``)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = ConvStack(config)
        self.encoder_transformer = Transformer(config)
        kernel = config.downsample_kernel
        self.downsample = CausalConv(config.hidden_size, config.hidden_size, kernel, stride=2, bias=False,
                                     pad_mode="replicate") if kernel else None
        self.quantizer = SplitQuantizer(config)

    def latents(self, audio: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` samples to the quantizer's input ``[B, hidden, T]``."""
        x = self.encoder(audio[:, None])
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.downsample(x) if self.downsample is not None else x

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """A clip's samples ``[N]`` (24 kHz, in the encoder's dtype and device) to codes
        ``[ceil(N / samples_per_frame), Q]`` (int64)."""
        if audio.dim() != 1 or audio.numel() == 0:
            raise ValueError(f"audio must be a non-empty [N] waveform, got {tuple(audio.shape)}")
        codes = self.quantizer(self.latents(audio[None]))[0]
        frames = -(-audio.numel() // self.config.samples_per_frame)
        return codes[:, :frames].T.contiguous()
