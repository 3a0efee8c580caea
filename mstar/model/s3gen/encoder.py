"""S3Gen's speech-token encoder (CosyVoice2's and Chatterbox's ``UpsampleConformerEncoder``):
token embeddings ``[B, L, width]`` -> ``upsample`` frames per token ``[B, 2L, width]``, the
input of the flow's ``encoder_proj``.

The stages, in order:

1. ``embed``: a linear map and LayerNorm, then the product with ``sqrt(width)`` (the ESPnet
   relative-position front scales its input; the positions go to attention, not the sum);
2. ``pre_lookahead_layer``: a residual pair of convolutions over tokens, the first reading
   ``lookahead`` (3) tokens ahead (zeros past the end), leaky ReLU, the second reading two back;
3. ``blocks`` pre-norm blocks (``encoders``): self-attention with ESPnet's relative positions,
   then a SiLU feed-forward, each added to its input;
4. ``up_layer``: every token repeated ``upsample`` times, then a convolution reading
   ``2 * upsample`` frames back;
5. ``up_embed`` (a second linear front) and ``up_blocks`` more blocks (``up_encoders``) over the
   frames, then ``after_norm``.

Relative-position attention (Transformer-XL's, as ESPnet's ``RelPositionMultiHeadedAttention``
writes it): the score of query ``i`` and key ``j`` is ``(q_i + u) . k_j + (q_i + v) . p(i - j)``
over ``sqrt(head_dim)``, with learned per-head biases ``u``, ``v`` (``pos_bias_u``/``_v``) and
``p`` the projected (``linear_pos``, no bias) sinusoid of the offset ``i - j``. Padded keys are
masked; padded queries are computed and left to the caller's mask.

The released block is the conformer layer with its convolution module and macaron
feed-forward switched off (``use_cnn_module=False``, ``macaron_style=False``), so a block here
is the attention and feed-forward pair only. Parameter names are the released ones under
``flow.encoder.`` (``s3gen_name_map``). The reference's chunk masks are off in S3Gen
(``static_chunk_size=0``): every frame attends to every valid frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConformerBlock", "EncoderConfig", "RelPositionAttention", "UpsampleConformerEncoder",
           "relative_positions"]


@dataclass(frozen=True)
class EncoderConfig:
    """The defaults are S3Gen's (and CosyVoice2-0.5B's) encoder."""

    width: int = 512  # the token embedding's width in, the frames' width out
    heads: int = 8
    ffn_width: int = 2048
    blocks: int = 6  # over tokens
    up_blocks: int = 4  # over frames
    lookahead: int = 3  # tokens the pre-look-ahead conv reads ahead
    upsample: int = 2  # frames per token
    max_positions: int = 5000  # the sinusoid table's length (grows for longer inputs)

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        if self.width % 2:
            raise ValueError(f"width must be even (sine and cosine pairs), got {self.width}")


def relative_positions(width: int, length: int, max_positions: int = 5000) -> torch.Tensor:
    """The sinusoids of the offsets ``length - 1`` down to ``-(length - 1)``, ``[1, 2 * length
    - 1, width]`` fp32: sine in the even channels, cosine in the odd ones. Computed over a
    table of ``max(max_positions, length)`` offsets and sliced, as the reference does, so the
    vectorised sine sees the same arguments."""
    n = max(max_positions, length)
    position = torch.arange(n, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * -(math.log(10000.0) / width))
    angles = position * inv_freq
    ahead, behind = torch.zeros(n, width), torch.zeros(n, width)
    ahead[:, 0::2], ahead[:, 1::2] = torch.sin(angles), torch.cos(angles)
    behind[:, 0::2], behind[:, 1::2] = torch.sin(-angles), torch.cos(-angles)
    table = torch.cat([ahead.flip(0), behind[1:]])  # offsets n - 1 ... 0 ... -(n - 1)
    return table[n - length:n + length - 1][None]


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with relative positions (see the module docstring)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, width]`` -> ``[B, T, heads, head_dim]``."""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, width]``, ``positions`` ``[1, 2T - 1, width]`` (``relative_positions``),
        ``key_mask`` ``[B, 1, T]`` bool (True: a valid key) -> ``[B, T, width]``."""
        b, t, _ = x.shape
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        p = self._heads(self.linear_pos(positions)).transpose(1, 2)  # [1, H, 2T - 1, D]
        content = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, T, T]
        by_offset = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)  # [B, H, T, 2T - 1]
        # column c of by_offset is the offset t - 1 - c; key j of query i sits at c = t - 1 - i + j
        rows = torch.arange(t, device=x.device)
        index = (t - 1 - rows[:, None] + rows[None, :]).expand(b, self.heads, t, t)
        scores = (content + by_offset.gather(-1, index)) / math.sqrt(self.head_dim)
        masked = ~key_mask[:, None]  # [B, 1, 1, T]
        weights = torch.softmax(scores.masked_fill(masked, -math.inf), dim=-1).masked_fill(masked, 0.0)
        out = (weights @ v).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out)


class _FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(width, hidden)
        self.w_2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm relative-position self-attention, then a SiLU feed-forward, both residual (the
    released conformer layer, whose convolution module and macaron half are off)."""

    def __init__(self, width: int, heads: int, ffn_width: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(width, heads)
        self.feed_forward = _FeedForward(width, ffn_width)
        self.norm_mha = nn.LayerNorm(width, eps=1e-12)
        self.norm_ff = nn.LayerNorm(width, eps=1e-12)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), positions, key_mask)
        return x + self.feed_forward(self.norm_ff(x))


class _LinearFront(nn.Module):
    """Linear, LayerNorm, times ``sqrt(width)`` (``out.0``/``out.1``: the reference's names)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, eps=1e-5))
        self.scale = math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class _PreLookahead(nn.Module):
    """The residual look-ahead pair over tokens ``[B, L, width]``."""

    def __init__(self, width: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(width, width, lookahead + 1)
        self.conv2 = nn.Conv1d(width, width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.lookahead))))
        return x + self.conv2(F.pad(h, (2, 0))).transpose(1, 2)


class _Upsample(nn.Module):
    """Each token repeated ``rate`` times, then a conv reading ``2 * rate`` frames back."""

    def __init__(self, width: int, rate: int) -> None:
        super().__init__()
        self.rate = rate
        self.conv = nn.Conv1d(width, width, 2 * rate + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, width]`` -> ``[B, rate * L, width]``."""
        frames = x.transpose(1, 2).repeat_interleave(self.rate, dim=-1)
        return self.conv(F.pad(frames, (2 * self.rate, 0))).transpose(1, 2)


class UpsampleConformerEncoder(nn.Module):
    """Token embeddings ``[B, L, width]`` -> frames ``[B, upsample * L, width]``."""

    def __init__(self, config: EncoderConfig = EncoderConfig()) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed = _LinearFront(c.width)
        self.pre_lookahead_layer = _PreLookahead(c.width, c.lookahead)
        self.encoders = nn.ModuleList(ConformerBlock(c.width, c.heads, c.ffn_width) for _ in range(c.blocks))
        self.up_layer = _Upsample(c.width, c.upsample)
        self.up_embed = _LinearFront(c.width)
        self.up_encoders = nn.ModuleList(ConformerBlock(c.width, c.heads, c.ffn_width) for _ in range(c.up_blocks))
        self.after_norm = nn.LayerNorm(c.width, eps=1e-5)

    def _blocks(self, blocks: nn.ModuleList, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        key_mask = (torch.arange(t, device=x.device)[None] < lengths[:, None])[:, None]
        positions = relative_positions(self.config.width, t, self.config.max_positions).to(x)
        for block in blocks:
            x = block(x, positions, key_mask)
        return x

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor,
                solo_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings ``[B, L, width]`` (zero past each row's length) and their lengths
        ``[B]`` -> (frames ``[B, upsample * L, width]``, frame lengths ``[B]``).

        ``solo_rows``: zero the padding after the input projection, so that the look-ahead conv
        reads zeros past a row's end as it does when the row runs alone, and each row's valid
        frames are its solo encoding's. The reference leaves the projection of the zero padding
        there (its S3Gen runs one row at a time); an unpadded batch is the same either way."""
        x = self.embed(tokens)
        if solo_rows:
            x = x * (torch.arange(x.shape[1], device=x.device)[None] < lengths[:, None])[..., None]
        x = self.pre_lookahead_layer(x)
        x = self._blocks(self.encoders, x, lengths)
        x = self.up_embed(self.up_layer(x))
        frame_lengths = lengths * self.config.upsample
        return self.after_norm(self._blocks(self.up_encoders, x, frame_lengths)), frame_lengths
