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

``push_many`` runs several calls' chunks together: each call's subsampling window on its
own (their lengths differ), then the conformer blocks once over every call's new frames,
padded to the longest, each call's cached keys right-aligned before its new frames so that
one band of relative distances serves them all; padded keys are masked, padded queries
dropped, and the causal convolutions never see the padding after a call's frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.layers.paged_kv import to_device
from mstar.model.fastconformer.encoder import ConformerBlock, FastConformerEncoder, RelPositionAttention

_REACH = 2  # encoder frames of extra mel context the subsampling window takes


class _LayerState:
    def __init__(self, block: ConformerBlock, width: int, dtype: torch.dtype, device: torch.device) -> None:
        attn = block.self_attn
        self.k = torch.zeros(0, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(0, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.conv = torch.zeros(block.conv.kernel - 1, width, dtype=dtype, device=device)  # the causal padding


class EncoderStream:
    """One call's encoder state: ``push`` final log-mel frames ``[n, mel]``, get the encoder
    frames ``[m, hidden]`` no later audio can change; ``push(..., last=True)`` gives the rest."""

    def __init__(self, encoder: FastConformerEncoder) -> None:
        config = encoder.config
        if not config.causal or config.subsampling_factor != 8:
            raise ValueError("only the causal FastConformer layout with 8x subsampling can stream")
        self.encoder = encoder
        self.left_context = config.left_context if config.left_context is not None else 1 << 30
        param = next(encoder.parameters())
        self.mel = torch.zeros(0, config.num_mel_bins, dtype=param.dtype, device=param.device)
        self.mel_start = 0  # the global index of ``mel``'s first frame
        self.mel_count = 0
        self.frames = 0  # encoder frames given out so far
        self.layers = [_LayerState(block, config.hidden_size, param.dtype, param.device) for block in encoder.layers]

    def push(self, mel: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        return push_many([self], [mel], [last])[0]

    def _subsample(self, mel: torch.Tensor, last: bool) -> torch.Tensor:
        """The new frames' subsampled inputs ``[n, hidden]`` (n may be 0); advances the mel state."""
        mel = to_device(mel, self.mel.device).to(self.mel.dtype)
        self.mel = torch.cat([self.mel, mel])
        self.mel_count += mel.shape[0]
        if last:
            upto = self.encoder.config.frames(self.mel_count)
        else:
            upto = (self.mel_count - 1) // 8 + 1 if self.mel_count else 0
        if upto <= self.frames:
            return self.mel.new_zeros(0, self.encoder.config.hidden_size)
        first = max(0, self.frames - _REACH)  # the window starts on the 8-frame grid
        window = self.mel[8 * first - self.mel_start:]
        lengths = to_device(torch.tensor([window.shape[0]]), window.device)
        x, _ = self.encoder.subsampling(window[None], lengths)
        x = x[0, self.frames - first: upto - first] * self.encoder.input_scale
        self.frames = upto
        keep = 8 * max(0, self.frames - _REACH)
        self.mel, self.mel_start = self.mel[keep - self.mel_start:], keep
        return x


def push_many(streams: list[EncoderStream], mels: list[torch.Tensor], lasts: list[bool]) -> list[torch.Tensor]:
    """Each call's ``push``, the conformer blocks run once over every call's new frames."""
    xs = [stream._subsample(mel, last) for stream, mel, last in zip(streams, mels, lasts)]
    counts = [x.shape[0] for x in xs]
    live = [i for i, n in enumerate(counts) if n]
    if not live:
        return xs
    encoder = streams[live[0]].encoder
    longest = max(counts)
    x = torch.stack([F.pad(xs[i], (0, 0, 0, longest - counts[i])) for i in live])  # [B, N, C]
    group = [streams[i] for i in live]
    sizes = [counts[i] for i in live]  # host ints: reading a device tensor per call and layer syncs
    for index, block in enumerate(encoder.layers):
        states = [stream.layers[index] for stream in group]
        x = _block(block, states, x, sizes, group[0].left_context)
    out = list(xs)
    for row, i in enumerate(live):
        out[i] = x[row, :counts[i]]
    return out


def _block(block: ConformerBlock, states: list[_LayerState], x: torch.Tensor, sizes: list[int],
           left_context: int) -> torch.Tensor:
    x = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
    x = x + _attend(block.self_attn, states, block.norm_self_att(x), sizes, left_context)
    x = x + _convolve(block, states, block.norm_conv(x), sizes)
    x = x + 0.5 * block.feed_forward2(block.norm_feed_forward2(x))
    return block.norm_out(x)


def _attend(attn: RelPositionAttention, states: list[_LayerState], x: torch.Tensor, sizes: list[int],
            left_context: int) -> torch.Tensor:
    """The new frames' queries over each call's cached keys and its own new ones. Keys sit at
    ``[C - c_b, C)`` (the cache, right-aligned) and ``[C, C + n_b)`` (new) of a row of
    ``C + N``; query ``i`` sits at ``C + i``, so the distance to key ``j`` is ``C + i - j`` for
    every call, and the position term is read per distance as the offline pass's."""
    batch, n, width = x.shape
    heads, dim = attn.num_heads, attn.head_dim
    q = attn.q_proj(x).view(batch, n, heads, dim)
    k_new = attn.k_proj(x).view(batch, n, heads, dim)
    v_new = attn.v_proj(x).view(batch, n, heads, dim)
    cached = max(state.k.shape[0] for state in states)
    total = cached + n
    keys = x.new_zeros(batch, total, heads, dim)
    values = x.new_zeros(batch, total, heads, dim)
    valid = torch.zeros(batch, total, dtype=torch.bool)  # built on the host, copied once
    for b, state in enumerate(states):
        c = state.k.shape[0]
        keys[b, cached - c:cached], values[b, cached - c:cached] = state.k, state.v
        valid[b, cached - c:cached + sizes[b]] = True
    valid = to_device(valid, x.device)
    keys[:, cached:], values[:, cached:] = k_new, v_new
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, width, 2, dtype=torch.float32, device=x.device) / width))
    distances = torch.arange(total - 1, -n, -1, dtype=torch.float32, device=x.device)
    angles = distances[:, None] * inv_freq[None, :]
    positions = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(distances), width)
    r = attn.relative_k_proj(positions.to(x.dtype)).view(len(distances), heads, dim)
    scaled = (q + attn.bias_v) * dim ** -0.5
    by_distance = torch.einsum("bnhd,phd->bhnp", scaled, r)  # [B, H, n, P]
    distance = cached + torch.arange(n, device=x.device)[:, None] - torch.arange(total, device=x.device)[None, :]
    column = ((total - 1) - distance).clamp(0, len(distances) - 1)  # the row of ``positions`` at that distance
    bias = by_distance.gather(3, column.expand(batch, heads, n, total))
    allowed = (distance >= 0) & (distance <= left_context)
    allowed = allowed[None, None] & valid[:, None, None, :]
    bias = bias.masked_fill(~allowed, torch.finfo(x.dtype).min)
    out = F.scaled_dot_product_attention((q + attn.bias_u).transpose(1, 2), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=bias)
    for b, state in enumerate(states):
        c, m = state.k.shape[0], sizes[b]
        state.k = keys[b, cached - c:cached + m][-left_context:]
        state.v = values[b, cached - c:cached + m][-left_context:]
    return attn.o_proj(out.transpose(1, 2).reshape(batch, n, heads * dim))


def _convolve(block: ConformerBlock, states: list[_LayerState], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The conv module over each call's last ``kernel - 1`` inputs and its new ones (the
    padding after a call's frames only reaches padded outputs: the convolution is causal)."""
    conv = block.conv
    y = F.glu(F.linear(x, conv.pointwise_conv1.weight.squeeze(-1), conv.pointwise_conv1.bias), dim=-1)
    history = torch.cat([torch.stack([state.conv for state in states]), y], dim=1)  # [B, kernel - 1 + N, C]
    reach = conv.kernel - 1
    for b, state in enumerate(states):
        state.conv = history[b, sizes[b]:sizes[b] + reach]
    image = history.transpose(1, 2).unsqueeze(2)  # [B, C, 1, kernel - 1 + N]
    weight = conv.depthwise_conv.weight.unsqueeze(2)
    y = F.conv2d(image, weight, conv.depthwise_conv.bias, groups=y.shape[2]).squeeze(2).transpose(1, 2)
    y = conv.norm(y)
    return F.linear(conv.act(y), conv.pointwise_conv2.weight.squeeze(-1), conv.pointwise_conv2.bias)
