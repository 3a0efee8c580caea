"""The streaming layout of the FastConformer encoder, run chunk by chunk for many calls.

For the causal layout at lookahead 0 (each frame attends to itself and the ``left_context``
frames before it; convolutions padded on the left only), a frame's hidden state depends on
no later audio. ``EncoderStreams`` keeps the state of up to ``slots`` calls and runs each
chunk of new log-mel frames over its new encoder frames only:

- the subsampling stack reruns over the newest mel frames from 16 before the first new
  encoder frame's (three stride-2 convolutions of kernel 3 reach 14 frames back; the two
  extra frames absorb the window's own zero padding), keeping the frames whose last mel frame
  arrived: frame ``k`` reads mel frames ``8k - 14 .. 8k``. Calls whose windows have the same
  shape (every call of a steady 80 ms tick) run it as one batch;
- each conformer block keeps, per call, its attention keys and values for the last
  ``left_context`` frames and its depthwise convolution's last ``kernel - 1`` inputs, in
  pooled tensors (``[layers, slots, ...]``) indexed by the call's slot.

So a chunk costs the same however long the call has run, and the frames out of all chunks
equal ``FastConformerEncoder.forward(mel, lookahead=0)`` of the whole call (to float
rounding: the attention sums over more masked keys).

``blocks`` runs the conformer blocks once over every call's new frames, padded to the
longest: a call's cached keys fill a fixed ``left_context`` columns, right-aligned (its first
``left_context - filled`` are masked), then its new frames, so one band of relative distances
serves every call and every step has the same shapes. Padded keys are masked, padded queries
dropped, the causal convolutions never see the padding after a call's frames, and the states
go back by slot (``index_copy_``). It reads nothing back to the host and loops over no call,
so a step of one new frame per call is the same kernels at any call count: the duplex encoder
replays it from a CUDA graph per batch bucket (padded rows use the sink slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.layers.paged_kv import to_device
from mstar.model.fastconformer.encoder import ConformerBlock, FastConformerEncoder, RelPositionAttention, sinusoids

_REACH = 2  # encoder frames of extra mel context the subsampling window takes


@dataclass
class _Call:
    """One call's host-side state: the mel frames its next subsampling window reads (on the
    device), and its counts."""

    mel: torch.Tensor
    mel_start: int = 0  # the global index of ``mel``'s first frame
    mel_count: int = 0
    frames: int = 0  # encoder frames given out so far
    filled: int = 0  # frames in its key/value cache (at most ``left_context``)


@dataclass
class Chunk:
    """A step's new frames: ``x`` ``[B, N, hidden]`` (the live calls' subsampled frames, padded
    to the longest), their ``slots``, each call's cached frames ``filled`` and new frames
    ``sizes`` (host lists), and ``live``: the index of each row's call among those pushed."""

    x: torch.Tensor
    slots: list[int]
    filled: list[int]
    sizes: list[int]
    live: list[int]


class _Step:
    """What every layer of one ``blocks`` call shares: the slots, the attention mask and
    position columns, and the gather indexes of the states kept."""

    def __init__(self, streams: EncoderStreams, slots: torch.Tensor, filled: torch.Tensor, sizes: torch.Tensor,
                 n: int) -> None:
        width, device = streams.width, slots.device
        total = width + n
        self.slots = slots
        keys = torch.arange(total, device=device)
        valid = (keys[None, :] >= width - filled[:, None]) & (keys[None, :] < width + sizes[:, None])  # [B, T]
        distance = width + torch.arange(n, device=device)[:, None] - keys[None, :]  # [n, T]
        near = (distance >= 0) & (distance <= streams.left_context)
        self.allowed = near[None, None] & valid[:, None, None, :]  # [B, 1, n, T]
        self.positions = streams.positions(n)
        self.column = ((total - 1) - distance).clamp(0, self.positions.shape[0] - 1)  # [n, T]
        self.keep = sizes[:, None] + torch.arange(width, device=device)[None, :]  # [B, width]
        self.keep_conv = sizes[:, None] + torch.arange(streams.reach, device=device)[None, :]


class EncoderStreams:
    """The encoder state of up to ``slots`` calls: ``open(slot)``, then ``push`` final log-mel
    frames ``[n, mel]`` per call, getting the encoder frames ``[m, hidden]`` no later audio can
    change; ``push(..., lasts=[True])`` gives the rest. ``close(slot)`` forgets the call."""

    def __init__(self, encoder: FastConformerEncoder, slots: int) -> None:
        config = encoder.config
        if not config.causal or config.subsampling_factor != 8:
            raise ValueError("only the causal FastConformer layout with 8x subsampling can stream")
        if config.left_context is None or config.left_context < 1:
            raise ValueError("streaming needs a finite left_context (the frames a call's cache keeps)")
        self.encoder = encoder
        self.left_context = self.width = config.left_context
        param = next(encoder.parameters())
        self.dtype, self.device = param.dtype, param.device
        attn, conv = encoder.layers[0].self_attn, encoder.layers[0].conv
        self.reach = conv.kernel - 1
        layers = len(encoder.layers)
        self.keys = torch.zeros(layers, slots, self.width, attn.num_heads, attn.head_dim, dtype=self.dtype,
                                device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.convs = torch.zeros(layers, slots, self.reach, config.hidden_size, dtype=self.dtype, device=self.device)
        self.calls: list[_Call | None] = [None] * slots
        self._positions: dict[int, torch.Tensor] = {}

    def open(self, slot: int) -> None:
        self.calls[slot] = _Call(torch.zeros(0, self.encoder.config.num_mel_bins, dtype=self.dtype,
                                             device=self.device))
        self.convs[:, slot].zero_()  # the causal padding (the keys are masked until filled)

    def close(self, slot: int) -> None:
        self.calls[slot] = None

    def positions(self, n: int) -> torch.Tensor:
        """The sinusoids ``[width + 2n - 1, hidden]`` of the relative distances ``width + n - 1``
        down to ``-(n - 1)`` (made once per ``n``)."""
        if n not in self._positions:
            distances = torch.arange(self.width + n - 1, -n, -1, dtype=torch.float32, device=self.device)
            self._positions[n] = sinusoids(distances, self.encoder.config.hidden_size, self.dtype)
        return self._positions[n]

    def push(self, slots: list[int], mels: list[torch.Tensor], lasts: list[bool]) -> list[torch.Tensor]:
        """Each call's new final frames (``[0, hidden]`` when it has none yet)."""
        chunk = self.subsample(slots, mels, lasts)
        out = [self.empty() for _ in slots]
        if chunk is not None:
            x = self.blocks(chunk.x, *self.step_inputs(chunk))
            for row, i in enumerate(chunk.live):
                out[i] = x[row, :chunk.sizes[row]]
            self.advance(chunk)
        return out

    def empty(self) -> torch.Tensor:
        return torch.zeros(0, self.encoder.config.hidden_size, dtype=self.dtype, device=self.device)

    # -- the subsampling, per window shape -------------------------------------------------
    def subsample(self, slots: list[int], mels: list[torch.Tensor], lasts: list[bool]) -> Chunk | None:
        """Advance each call's mel window; the new frames of the calls that have any (None:
        no call has). The calls' counts move on only in ``advance``."""
        windows: dict[tuple[int, int, int], list[int]] = {}  # (window length, from, to) -> calls
        spans = []
        for i, (slot, mel, last) in enumerate(zip(slots, mels, lasts, strict=True)):
            call = self.calls[slot]
            mel = to_device(mel, self.device).to(self.dtype)
            call.mel = torch.cat([call.mel, mel]) if mel.shape[0] else call.mel
            call.mel_count += mel.shape[0]
            if last:
                upto = self.encoder.config.frames(call.mel_count)
            else:
                upto = (call.mel_count - 1) // 8 + 1 if call.mel_count else 0
            spans.append(upto)
            if upto <= call.frames:
                continue
            first = max(0, call.frames - _REACH)  # the window starts on the 8-frame grid
            length = call.mel.shape[0] - (8 * first - call.mel_start)
            windows.setdefault((length, call.frames - first, upto - first), []).append(i)
        if not windows:
            return None
        rows: dict[int, torch.Tensor] = {}
        for (length, start, stop), group in windows.items():
            batch = torch.stack([self.calls[slots[i]].mel[-length:] for i in group])
            lengths = torch.full((len(group),), length, dtype=torch.int64, device=self.device)
            x, _ = self.encoder.subsampling(batch, lengths)
            x = x[:, start:stop] * self.encoder.input_scale
            for row, i in enumerate(group):
                rows[i] = x[row]
        live = sorted(rows)
        sizes = [rows[i].shape[0] for i in live]
        if len(windows) > 1:  # (one window shape: its batch is the step's, in the calls' order)
            longest = max(sizes)
            x = torch.stack([F.pad(rows[i], (0, 0, 0, longest - rows[i].shape[0])) for i in live])
        for i, upto in enumerate(spans):  # the mel frames the next windows read
            call = self.calls[slots[i]]
            if i in rows:
                call.frames = upto
            keep = 8 * max(0, call.frames - _REACH)
            call.mel, call.mel_start = call.mel[keep - call.mel_start:], keep
        return Chunk(x, [slots[i] for i in live], [self.calls[slots[i]].filled for i in live], sizes, live)

    def step_inputs(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``chunk``'s slots, cached and new frame counts as device tensors (one upload each)."""
        return tuple(to_device(torch.tensor(v, dtype=torch.int64), self.device)
                     for v in (chunk.slots, chunk.filled, chunk.sizes))

    def advance(self, chunk: Chunk) -> None:
        """The calls' cache counts after ``blocks`` ran ``chunk``."""
        for slot, size in zip(chunk.slots, chunk.sizes, strict=True):
            call = self.calls[slot]
            call.filled = min(self.width, call.filled + size)

    # -- the conformer blocks ---------------------------------------------------------------
    def blocks(self, x: torch.Tensor, slots: torch.Tensor, filled: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The conformer blocks over the new frames ``x`` ``[B, N, hidden]`` of the calls in
        ``slots`` (``filled``: their cached frames, ``sizes``: their real new frames, all
        ``[B]`` device tensors), updating their states in place."""
        step = _Step(self, slots, filled, sizes, x.shape[1])
        for index, block in enumerate(self.encoder.layers):
            x = self._block(index, block, x, step)
        return x

    def _block(self, index: int, block: ConformerBlock, x: torch.Tensor, step: _Step) -> torch.Tensor:
        x = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
        x = x + self._attend(index, block.self_attn, block.norm_self_att(x), step)
        x = x + self._convolve(index, block, block.norm_conv(x), step)
        x = x + 0.5 * block.feed_forward2(block.norm_feed_forward2(x))
        return block.norm_out(x)

    def _attend(self, index: int, attn: RelPositionAttention, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """The new frames' queries over each call's cached keys and its own new ones. Keys sit
        at ``[0, W)`` (the cache, right-aligned) and ``[W, W + n_b)`` (new) of a row of
        ``W + N``; query ``i`` sits at ``W + i``, so the distance to key ``j`` is ``W + i - j``
        for every call, and the position term is read per distance as the offline pass's."""
        batch, n, _ = x.shape
        heads, dim = attn.num_heads, attn.head_dim
        q = attn.q_proj(x).view(batch, n, heads, dim)
        keys = torch.cat([self.keys[index].index_select(0, step.slots), attn.k_proj(x).view(batch, n, heads, dim)], 1)
        values = torch.cat([self.values[index].index_select(0, step.slots),
                            attn.v_proj(x).view(batch, n, heads, dim)], 1)
        total = keys.shape[1]
        r = attn.relative_k_proj(step.positions).view(-1, heads, dim)
        scaled = (q + attn.bias_v) * dim ** -0.5
        by_distance = torch.einsum("bnhd,phd->bhnp", scaled, r)  # [B, H, n, P]
        bias = by_distance.gather(3, step.column.expand(batch, heads, n, total))
        bias = bias.masked_fill(~step.allowed, torch.finfo(x.dtype).min)
        out = F.scaled_dot_product_attention((q + attn.bias_u).transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=bias)
        keep = step.keep[:, :, None, None]  # each call's last W keys: its cache, then its new ones
        self.keys[index].index_copy_(0, step.slots, torch.take_along_dim(keys, keep, dim=1))
        self.values[index].index_copy_(0, step.slots, torch.take_along_dim(values, keep, dim=1))
        return attn.o_proj(out.transpose(1, 2).reshape(batch, n, heads * dim))

    def _convolve(self, index: int, block: ConformerBlock, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """The conv module over each call's last ``kernel - 1`` inputs and its new ones (the
        padding after a call's frames only reaches padded outputs: the convolution is causal)."""
        conv = block.conv
        y = F.glu(F.linear(x, conv.pointwise_conv1.weight.squeeze(-1), conv.pointwise_conv1.bias), dim=-1)
        history = torch.cat([self.convs[index].index_select(0, step.slots), y], dim=1)  # [B, kernel - 1 + N, C]
        self.convs[index].index_copy_(0, step.slots, torch.take_along_dim(history, step.keep_conv[:, :, None], dim=1))
        image = history.transpose(1, 2).unsqueeze(2)  # [B, C, 1, kernel - 1 + N]
        weight = conv.depthwise_conv.weight.unsqueeze(2)
        y = F.conv2d(image, weight, conv.depthwise_conv.bias, groups=y.shape[2]).squeeze(2).transpose(1, 2)
        y = conv.norm(y)
        return F.linear(conv.act(y), conv.pointwise_conv2.weight.squeeze(-1), conv.pointwise_conv2.bias)


class EncoderStream:
    """One call's stream (an ``EncoderStreams`` of one slot): ``push`` final log-mel frames
    ``[n, mel]``, get the encoder frames ``[m, hidden]`` no later audio can change;
    ``push(..., last=True)`` gives the rest."""

    def __init__(self, encoder: FastConformerEncoder) -> None:
        self.streams = EncoderStreams(encoder, 1)
        self.streams.open(0)

    @property
    def call(self) -> _Call:
        return self.streams.calls[0]

    def push(self, mel: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        return self.streams.push([0], [mel], [last])[0]
