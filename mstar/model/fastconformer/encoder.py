"""The FastConformer encoder: log-mel frames in, one hidden state per 80 ms out.

8x subsampling by strided depthwise-separable 2-D convolutions (or, with a subsampling factor
of 1, a linear projection of each frame: Canary-Qwen's modality adapter), then conformer blocks:
half a feed-forward, self-attention with Transformer-XL relative positions (content and
position terms with their own learned biases, ``bias_u`` and ``bias_v``), a convolution
module (pointwise GLU, depthwise convolution, norm, activation, pointwise), the other half
feed-forward, a final layer norm.

The streaming layout (``config.causal``) pads its convolutions on the left only, normalises
the conv module with a layer norm, and attends in chunks of ``lookahead + 1`` frames: a frame
sees its own chunk and the ``left_context // (lookahead + 1)`` chunks before it. Served over
whole clips, that is the widest lookahead's accuracy with none of the streaming caches.

Parameter names are the Hugging Face checkpoints' (``ParakeetEncoder``,
``NemotronAsrStreamingEncoder``), so weights load by name. A batch of clips of different
lengths is padded; padded frames never reach a real one (keys are masked, convolutions see
zeros there), so a clip encodes the same alone or in any batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.fastconformer.config import FastConformerConfig

_ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


def activation(name: str):
    return _ACTIVATIONS[name]


def sinusoids(distances: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal embeddings ``[len(distances), dim]`` of float32 relative distances: sine and
    cosine of each frequency side by side."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=distances.device) / dim))
    angles = distances[:, None] * inv_freq[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(distances), dim).to(dtype)


def relative_positions(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``sinusoids`` ``[2 * length - 1, dim]`` of the relative positions ``length - 1, ...,
    -(length - 1)``."""
    return sinusoids(torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32), dim, dtype)


def lengths_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, size]``: True at the first ``lengths[b]`` positions of row ``b``."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


class FeedForward(nn.Module):
    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        self.linear1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.attention_bias)
        self.linear2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.attention_bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.act(self.linear1(x)))


class RelPositionAttention(nn.Module):
    """Multi-head self-attention over content and relative position (Transformer-XL).

    The content scores and the weighted sum run in ``F.scaled_dot_product_attention`` (a fused
    kernel on the GPU: no ``[B, H, T, T]`` softmax in float32 is materialised); the position
    scores enter it as an additive bias, with the mask."""

    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        width, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(width, width, bias=bias)
        self.k_proj = nn.Linear(width, width, bias=bias)
        self.v_proj = nn.Linear(width, width, bias=bias)
        self.o_proj = nn.Linear(width, width, bias=bias)
        self.relative_k_proj = nn.Linear(width, width, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # content bias
        self.bias_v = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # position bias

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, C]``, ``positions`` ``[P, C]`` (``P >= 2T - 1``: relative ``T - 1``
        down to ``-(T - 1)``, then rows never read), ``allowed`` a bool mask broadcastable to
        ``[B, H, T, T]``."""
        batch, length, _ = x.shape
        heads, dim = self.num_heads, self.head_dim
        q = self.q_proj(x).view(batch, length, heads, dim)
        k = self.k_proj(x).view(batch, length, heads, dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, heads, dim).transpose(1, 2)
        bias = self._position_scores(q, positions).masked_fill(~allowed, torch.finfo(x.dtype).min)
        # the position term and the mask are SDPA's additive bias (a finite minimum, not -inf,
        # so that a query with no key allowed (padding) gives no NaN)
        out = F.scaled_dot_product_attention((q + self.bias_u).transpose(1, 2), k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, heads * dim))

    def _position_scores(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The position term ``[B, H, T, T]`` of queries ``q`` ``[B, T, H, D]``, as a strided
        view (no copy) of one batched matmul: every query row against every relative offset
        (``[H, B * T, P]``, scaled on the ``[T, D]`` side), then the Transformer-XL shift:
        query ``i``, key ``j`` reads offset ``i - j``, which is column ``T - 1 - i + j`` of row
        ``i``, so the view steps ``P - 1`` elements a row and starts at column ``T - 1``."""
        batch, length, heads, dim = q.shape
        width = positions.shape[0]
        r = self.relative_k_proj(positions).view(width, heads, dim).permute(1, 2, 0)  # [H, D, P]
        scaled = ((q + self.bias_v) * dim ** -0.5).permute(2, 0, 1, 3).reshape(heads, batch * length, dim)
        by_offset = torch.bmm(scaled, r)  # [H, B * T, P]
        return by_offset.as_strided((batch, heads, length, length),
                                    (length * width, batch * length * width, width - 1, 1), length - 1)


class ConvModule(nn.Module):
    """Pointwise conv + GLU, depthwise conv (padded frames zeroed first), norm, activation,
    pointwise conv.

    It runs on ``[B, T, C]`` throughout: the pointwise convolutions are linears over the
    checkpoint's ``[out, in, 1]`` weights, and the depthwise one a 2-D convolution over a
    channels-last view of the same memory (height 1), so no ``[B, C, T]`` copy is made. Its
    padding is symmetric (``kernel - 1`` each side in the causal layout, whose first ``T``
    outputs are then the left-padded ones)."""

    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        channels, bias, kernel = config.hidden_size, config.convolution_bias, config.conv_kernel_size
        self.causal = config.causal
        self.kernel = kernel
        self.pointwise_conv1 = nn.Conv1d(channels, 2 * channels, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
        self.norm = nn.LayerNorm(channels) if config.causal else nn.BatchNorm1d(channels)
        self.pointwise_conv2 = nn.Conv1d(channels, channels, 1, bias=bias)
        self.act = activation(config.hidden_act)

    def _depthwise(self, y: torch.Tensor) -> torch.Tensor:
        """The depthwise convolution of ``y`` ``[B, T, C]`` along ``T``; ``[B, T, C]`` out."""
        batch, length, channels = y.shape
        conv = self.depthwise_conv
        image = y.transpose(1, 2).unsqueeze(2)  # [B, C, 1, T], channels-last in memory
        pad = self.kernel - 1 if self.causal else (self.kernel - 1) // 2
        out = F.conv2d(image, conv.weight.unsqueeze(2), conv.bias, padding=(0, pad), groups=channels)
        return out.squeeze(2)[:, :, :length].transpose(1, 2)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        y = F.glu(F.linear(x, self.pointwise_conv1.weight.squeeze(-1), self.pointwise_conv1.bias), dim=-1)
        y = self._depthwise(y * valid[:, :, None].to(y.dtype))
        if isinstance(self.norm, nn.LayerNorm):
            y = self.norm(y)
        else:  # BatchNorm1d normalises dim 1: the channels of a [B, C, T] view
            y = self.norm(y.transpose(1, 2)).transpose(1, 2)
        return F.linear(self.act(y), self.pointwise_conv2.weight.squeeze(-1), self.pointwise_conv2.bias)


class ConformerBlock(nn.Module):
    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.self_attn = RelPositionAttention(config)
        self.conv = ConvModule(config)
        self.feed_forward2 = FeedForward(config)
        self.norm_feed_forward1 = nn.LayerNorm(width)
        self.norm_self_att = nn.LayerNorm(width)
        self.norm_conv = nn.LayerNorm(width)
        self.norm_feed_forward2 = nn.LayerNorm(width)
        self.norm_out = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), positions, allowed)
        x = x + self.conv(self.norm_conv(x), valid)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


def _mask_time(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, C, T, F]`` with the frames past each row's length zeroed."""
    return x * lengths_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)


class StridedSubsampling(nn.Module):
    """Parakeet's layout: a stride-2 conv, then (depthwise stride-2, pointwise) pairs, ReLU
    after each; ``layers`` keeps the ReLUs so the convs keep the checkpoint's indices."""

    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        channels, kernel, stride = (config.subsampling_conv_channels, config.subsampling_conv_kernel_size,
                                    config.subsampling_conv_stride)
        pad = (kernel - 1) // 2
        layers: list[nn.Module] = [nn.Conv2d(1, channels, kernel, stride, pad), nn.ReLU()]
        for _ in range(config.num_subsampling_layers - 1):
            layers += [nn.Conv2d(channels, channels, kernel, stride, pad, groups=channels),
                       nn.Conv2d(channels, channels, 1), nn.ReLU()]
        self.layers = nn.ModuleList(layers)
        self.linear = nn.Linear(channels * config.subsampled_mel_bins, config.hidden_size)
        self.config = config

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = mel[:, None]  # [B, 1, T, F]
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, nn.Conv2d):
                if layer.stride[0] > 1:
                    lengths = (lengths + 2 * layer.padding[0] - layer.kernel_size[0]) // layer.stride[0] + 1
                x = _mask_time(x, lengths)
        return self.linear(x.transpose(1, 2).flatten(2)), lengths


class FrameProjection(nn.Module):
    """No subsampling (NeMo's ``subsampling_factor: 1``, Canary-Qwen's modality adapter): each
    input frame projected to the hidden size."""

    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.num_mel_bins, config.hidden_size)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), lengths


class CausalSubsamplingLayer(nn.Module):
    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        channels = config.subsampling_conv_channels
        self.depthwise_conv = nn.Conv2d(channels, channels, config.subsampling_conv_kernel_size,
                                        config.subsampling_conv_stride, groups=channels)
        self.pointwise_conv = nn.Conv2d(channels, channels, 1)


class CausalSubsampling(nn.Module):
    """The streaming layout: the same stack, each strided conv padded ``kernel - 1`` before
    and ``stride - 1`` after, in time and in frequency."""

    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        channels, kernel, stride = (config.subsampling_conv_channels, config.subsampling_conv_kernel_size,
                                    config.subsampling_conv_stride)
        self.pad = (kernel - 1, stride - 1)
        self.kernel, self.stride = kernel, stride
        self.conv_in = nn.Conv2d(1, channels, kernel, stride)
        self.layers = nn.ModuleList(CausalSubsamplingLayer(config) for _ in range(config.num_subsampling_layers - 1))
        self.linear = nn.Linear(channels * config.subsampled_mel_bins, config.hidden_size)

    def _strided(self, conv: nn.Conv2d, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        before, after = self.pad
        x = conv(F.pad(x, (before, after, before, after)))
        return x, (lengths + before + after - self.kernel) // self.stride + 1

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = self._strided(self.conv_in, mel[:, None], lengths)
        x = F.relu(_mask_time(x, lengths))
        for layer in self.layers:
            x, lengths = self._strided(layer.depthwise_conv, x, lengths)
            x = F.relu(_mask_time(layer.pointwise_conv(x), lengths))
        return self.linear(x.transpose(1, 2).flatten(2)), lengths


def attention_mask(valid: torch.Tensor, left_context: int | None, lookahead: int | None) -> torch.Tensor:
    """``[B, 1, T, T]`` (or ``[B, 1, 1, T]``): may query ``i`` attend to key ``j``? Keys past
    the clip never; with a ``lookahead``, only keys in the query's chunk of ``lookahead + 1``
    frames or the ``left_context // (lookahead + 1)`` chunks before it."""
    allowed = valid[:, None, None, :]
    if lookahead is None:
        return allowed
    size = lookahead + 1
    chunk = torch.arange(valid.shape[1], device=valid.device) // size
    back = chunk[:, None] - chunk[None, :]
    reach = left_context // size if left_context is not None and left_context >= 0 else valid.shape[1]
    return allowed & ((back >= 0) & (back <= reach))[None, None]


class FastConformerEncoder(nn.Module):
    def __init__(self, config: FastConformerConfig) -> None:
        super().__init__()
        self.config = config
        if config.subsampling_factor == 1:
            self.subsampling: nn.Module = FrameProjection(config)
        else:
            self.subsampling = CausalSubsampling(config) if config.causal else StridedSubsampling(config)
        self.layers = nn.ModuleList(ConformerBlock(config) for _ in range(config.num_hidden_layers))
        self.input_scale = math.sqrt(config.hidden_size) if config.scale_input else 1.0

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor | None = None,
                lookahead: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states ``[B, T', hidden]`` and their lengths ``[B]`` of log-mels ``[B, T, mel]``
        (``lengths``: real frames per row, default all). ``lookahead``: the streaming layout's
        right context (default the checkpoint's); ignored by the full-attention layout."""
        if lengths is None:
            lengths = torch.full((mel.shape[0],), mel.shape[1], dtype=torch.int64, device=mel.device)
        x, lengths = self.subsampling(mel, lengths.to(mel.device, torch.int64))
        x = x * self.input_scale
        frames = x.shape[1]
        positions = relative_positions(frames, self.config.hidden_size, x.device, x.dtype)
        # rows to a multiple of 8: the position matmul's output rows stay 16-byte aligned
        positions = F.pad(positions, (0, 0, 0, -positions.shape[0] % 8))
        valid = lengths_mask(lengths, frames)
        if self.config.causal:
            allowed = attention_mask(valid, self.config.left_context,
                                     self.config.default_lookahead if lookahead is None else lookahead)
        else:
            allowed = attention_mask(valid, None, None)
        for layer in self.layers:
            x = layer(x, positions, allowed, valid)
        return x, lengths
