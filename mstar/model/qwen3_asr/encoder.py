"""AuT, Qwen3-ASR's audio encoder, and the projector into the LLM.

A clip's log-mels ``[T, mel]`` are cut into chunks of ``2 * n_window`` frames (1 s; the last
one shorter, zero-padded). Every chunk of every clip in the batch goes through the three
stride-2 convolutions at once, gets a linear to ``d_model`` and the sinusoidal position table
from 0 again (positions are per chunk), and keeps only the positions its real frames reach.
The kept positions of a clip are then cut into attention windows of ``window_positions``
(8 chunks, 104 positions; the last one shorter): each layer's attention is block diagonal over
these windows. Windows of every clip of the batch, of different lengths, run as one padded
batch with a key mask (``window_layout``), so a batch of clips gives each clip the output it
gets alone. Parameter names are transformers' ``Qwen3ASREncoder``'s (and the projector's
``Qwen3ASRMultiModalProjector``'s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.qwen3_asr.config import AuTConfig, post_cnn_length


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table: sines then cosines over geometric timescales."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


@dataclass(frozen=True)
class WindowLayout:
    """Where the packed positions ``[N]`` of a batch sit in padded windows ``[W, L]``."""

    index: torch.Tensor  # [N] flat index into W * L
    key_mask: torch.Tensor  # [W, L] True where a window has a real position
    windows: int
    width: int


def window_layout(counts: list[int], window: int, device: torch.device) -> WindowLayout:
    """The attention windows of clips with ``counts`` encoder positions each."""
    lengths = []
    for n in counts:
        full, rest = divmod(n, window)
        lengths += [window] * full + ([rest] if rest else [])
    width = max(lengths)
    index = torch.cat([torch.arange(n, device=device) + w * width for w, n in enumerate(lengths)])
    mask = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return WindowLayout(index, mask, len(lengths), width)


class AuTAttention(nn.Module):
    def __init__(self, config: AuTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.encoder_attention_heads
        self.head_dim = d // self.heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        n, d = x.shape

        def windows(t: torch.Tensor) -> torch.Tensor:
            padded = t.new_zeros(layout.windows * layout.width, d).index_copy(0, layout.index, t)
            return padded.view(layout.windows, layout.width, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = windows(self.q_proj(x)), windows(self.k_proj(x)), windows(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask[:, None, None, :])
        out = out.transpose(1, 2).reshape(layout.windows * layout.width, d).index_select(0, layout.index)
        return self.out_proj(out)


class AuTLayer(nn.Module):
    def __init__(self, config: AuTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = AuTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), layout)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AuTEncoder(nn.Module):
    def __init__(self, config: AuTConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(hidden * config.freq_bins, config.d_model, bias=False)
        self.layers = nn.ModuleList(AuTLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        # float32, then the model's dtype: what building in float32 and casting gave
        table = sinusoids(post_cnn_length(config.chunk_frames), config.d_model).to(torch.get_default_dtype())
        self.register_buffer("positions", table, persistent=False)

    def chunks(self, mels: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Every clip's chunks ``[C, 1, mel, chunk]`` (zero-padded) and their real frame counts."""
        size = self.config.chunk_frames
        pieces, lengths = [], []
        for mel in mels:
            count = -(-mel.shape[0] // size)
            padded = F.pad(mel, (0, 0, 0, count * size - mel.shape[0]))
            pieces.append(padded.view(count, size, mel.shape[1]).transpose(1, 2))
            lengths += [min(size, mel.shape[0] - c * size) for c in range(count)]
        return torch.cat(pieces)[:, None], lengths

    def convolve(self, chunks: torch.Tensor) -> torch.Tensor:
        """``[C, steps, d_model]`` of chunks ``[C, 1, mel, chunk]``: convolutions, linear, positions."""
        x = F.gelu(self.conv2d1(chunks))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))
        c, channels, bins, steps = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, steps, channels * bins))
        return x + self.positions[:steps].to(x.dtype)

    def forward(self, mels: list[torch.Tensor], conv_batch: int = 500) -> list[torch.Tensor]:
        """Encoder states ``[positions(T_i), d_model]`` of each clip's log-mels ``[T_i, mel]``.
        The chunks go through the convolutions ``conv_batch`` at a time: the first one's output
        is 60x a chunk's input (480 channels at half the resolution), 0.7 GB in bfloat16 for
        a 20-minute clip's 1,200 chunks, and a batch may hold several such clips."""
        chunks, lengths = self.chunks(mels)
        x = torch.cat([self.convolve(part) for part in chunks.split(conv_batch)])
        c, steps = x.shape[:2]
        kept = torch.tensor([post_cnn_length(n) for n in lengths], device=x.device)
        valid = (torch.arange(steps, device=x.device)[None, :] < kept[:, None]).flatten().nonzero().squeeze(-1)
        x = x.reshape(c * steps, -1).index_select(0, valid)
        counts = [self.config.positions(mel.shape[0]) for mel in mels]
        layout = window_layout(counts, self.config.window_positions, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return list(self.ln_post(x).split(counts))


class AudioProjector(nn.Module):
    """Encoder states to LLM input embeddings: linear, GELU, linear."""

    def __init__(self, config: AuTConfig) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(config.d_model, config.d_model)
        self.linear_2 = nn.Linear(config.d_model, config.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


__all__ = ["AudioProjector", "AuTEncoder", "WindowLayout", "window_layout"]
