"""The streaming layout of the FastConformer encoder, run chunk by chunk.

For the causal layout at lookahead 0 (each frame attends to itself and the ``left_context``
frames before it; convolutions padded on the left only), a frame's hidden state depends on
no later audio. ``EncoderStream`` keeps one call's state and runs each chunk of new log-mel
frames over its new encoder frames only:

- the subsampling stack reruns over the newest mel frames from 16 before the first new
  encoder frame's (three stride-2 convolutions of kernel 3 reach 14 frames back; the two
  extra frames absorb the window's own zero padding), keeping the frames whose last mel frame
  arrived: frame ``k`` reads mel frames ``8k - 14 .. 8k``;
- each conformer block keeps its attention keys and values for the last ``left_context``
  frames and its depthwise convolution's last ``kernel - 1`` inputs.

So a chunk costs the same however long the call has run, and the frames out of all chunks
equal ``FastConformerEncoder.forward(mel, lookahead=0)`` of the whole call (to float
rounding: the attention sums over fewer masked keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.model.fastconformer.encoder import ConformerBlock, FastConformerEncoder, RelPositionAttention

_REACH = 2  # encoder frames of extra mel context the subsampling window takes


class _LayerState:
    def __init__(self, block: ConformerBlock, width: int, dtype: torch.dtype) -> None:
        attn = block.self_attn
        self.k = torch.zeros(0, attn.num_heads, attn.head_dim, dtype=dtype)
        self.v = torch.zeros(0, attn.num_heads, attn.head_dim, dtype=dtype)
        self.conv = torch.zeros(block.conv.kernel - 1, width, dtype=dtype)  # the causal padding at first


class EncoderStream:
    """One call's encoder state: ``push`` final log-mel frames ``[n, mel]``, get the encoder
    frames ``[m, hidden]`` no later audio can change; ``end`` gives the rest."""

    def __init__(self, encoder: FastConformerEncoder) -> None:
        config = encoder.config
        if not config.causal or config.subsampling_factor != 8:
            raise ValueError("only the causal FastConformer layout with 8x subsampling can stream")
        self.encoder = encoder
        self.left_context = config.left_context if config.left_context is not None else 1 << 30
        dtype = next(encoder.parameters()).dtype
        self.mel = torch.zeros(0, config.num_mel_bins, dtype=dtype)  # from global mel frame ``mel_start``
        self.mel_start = 0
        self.mel_count = 0
        self.frames = 0  # encoder frames given out so far
        self.layers = [_LayerState(block, config.hidden_size, dtype) for block in encoder.layers]

    def push(self, mel: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        mel = mel.to(self.mel.dtype)
        self.mel = torch.cat([self.mel, mel])
        self.mel_count += mel.shape[0]
        if last:
            upto = self.encoder.config.frames(self.mel_count)
        else:
            upto = (self.mel_count - 1) // 8 + 1 if self.mel_count else 0
        if upto <= self.frames:
            return self.mel.new_zeros(0, self.encoder.config.hidden_size)
        x = self._subsample(upto, last)
        for block, state in zip(self.encoder.layers, self.layers):
            x = self._block(block, state, x)
        self.frames = upto
        keep = 8 * max(0, self.frames - _REACH)
        self.mel, self.mel_start = self.mel[keep - self.mel_start:], keep
        return x

    def _subsample(self, upto: int, last: bool) -> torch.Tensor:
        first = max(0, self.frames - _REACH)  # the window starts on the 8-frame grid
        window = self.mel[8 * first - self.mel_start:]
        lengths = torch.tensor([window.shape[0]])
        x, _ = self.encoder.subsampling(window[None], lengths)
        x = x[0, self.frames - first: upto - first] * self.encoder.input_scale
        return x

    def _block(self, block: ConformerBlock, state: _LayerState, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
        x = x + self._attend(block.self_attn, state, block.norm_self_att(x))
        x = x + self._convolve(block, state, block.norm_conv(x))
        x = x + 0.5 * block.feed_forward2(block.norm_feed_forward2(x))
        return block.norm_out(x)

    def _attend(self, attn: RelPositionAttention, state: _LayerState, x: torch.Tensor) -> torch.Tensor:
        """The new frames' queries over the cached keys and their own: query ``i`` (global
        ``c + i`` past the cache's first) reads key ``j`` at distance ``c + i - j`` in
        ``[0, left_context]``; the position term is read per distance as the offline pass's."""
        n, heads, dim = x.shape[0], attn.num_heads, attn.head_dim
        q = attn.q_proj(x).view(n, heads, dim)
        k = torch.cat([state.k, attn.k_proj(x).view(n, heads, dim)])
        v = torch.cat([state.v, attn.v_proj(x).view(n, heads, dim)])
        cached = state.k.shape[0]
        total = cached + n
        # relative distances total - 1 down to -(n - 1), embedded as in ``relative_positions``
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, x.shape[1], 2, dtype=torch.float32) / x.shape[1]))
        distances = torch.arange(total - 1, -n, -1, dtype=torch.float32)
        angles = distances[:, None] * inv_freq[None, :]
        positions = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(distances), x.shape[1])
        r = attn.relative_k_proj(positions.to(x.dtype)).view(len(distances), heads, dim)
        scaled = (q + attn.bias_v) * dim ** -0.5
        by_distance = torch.einsum("nhd,phd->hnp", scaled, r)  # [H, n, P]
        query = torch.arange(n)[:, None]
        key = torch.arange(total)[None, :]
        distance = cached + query - key
        column = (total - 1) - distance  # the row of ``positions`` holding that distance
        bias = by_distance.gather(2, column.clamp(0, len(distances) - 1).expand(heads, n, total))
        allowed = (distance >= 0) & (distance <= self.left_context)
        bias = bias.masked_fill(~allowed, torch.finfo(x.dtype).min)
        out = F.scaled_dot_product_attention((q + attn.bias_u).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=bias[None])
        state.k, state.v = k[-self.left_context:], v[-self.left_context:]
        return attn.o_proj(out[0].transpose(0, 1).reshape(n, heads * dim))

    def _convolve(self, block: ConformerBlock, state: _LayerState, x: torch.Tensor) -> torch.Tensor:
        conv = block.conv
        y = F.glu(F.linear(x, conv.pointwise_conv1.weight.squeeze(-1), conv.pointwise_conv1.bias), dim=-1)
        history = torch.cat([state.conv, y])
        state.conv = history[-(conv.kernel - 1):]
        image = history.T[None, :, None, :]  # [1, C, 1, kernel - 1 + n]
        weight = conv.depthwise_conv.weight.unsqueeze(2)
        y = F.conv2d(image, weight, conv.depthwise_conv.bias, groups=y.shape[1])[0, :, 0].T
        y = conv.norm(y)
        return F.linear(conv.act(y), conv.pointwise_conv2.weight.squeeze(-1), conv.pointwise_conv2.bias)
