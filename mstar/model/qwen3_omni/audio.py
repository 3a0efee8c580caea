"""Qwen3-Omni's audio encoder (AuT): log-mel frames in, one thinker embedding per ~80 ms out.

The mel frames of each clip are cut into chunks of ``2 * n_window`` frames (100: one second
at the front's 10 ms hop; the last chunk shorter). Three stride-2 3x3 convolutions (GELU after
each) over (mel, time) shrink a chunk 8x in time (100 frames -> 13 tokens), a linear layer
flattens channels x mel into ``d_model``, and every chunk gets the sinusoid positions
``0 .. n-1`` of its own tokens. A pre-norm transformer (biased projections, GELU MLP) then
attends within windows of ``n_window_infer / (2 * n_window)`` chunks' worth of tokens
(8 chunks = 104 tokens in the released config), never across clips; a final LayerNorm,
``proj1``, GELU and ``proj2`` map into the thinker's hidden size.

The chunks of one call are zero-padded to the longest chunk before the convolutions, as the
reference does; the second and third convolutions see the first's output over that padding,
so a clip's last (short) chunk depends on whether the call has a full chunk. A clip of at
least ``2 * n_window`` frames (1 s) always makes one, and then the result is the clip's own.

Parameter names are the released checkpoint's ``thinker.audio_tower.`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.whisper.features import log_mel_spectrogram


@dataclass
class Qwen3OmniAudioConfig:
    """The audio encoder's hyper-parameters; names follow ``audio_config`` of ``config.json``."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    output_dim: int = 3584
    n_window: int = 50
    n_window_infer: int = 800
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self) -> None:
        if self.activation_function != "gelu":
            raise NotImplementedError(f"unsupported activation_function {self.activation_function!r}")
        if self.scale_embedding:
            raise NotImplementedError("scale_embedding is not supported")
        if self.d_model % self.encoder_attention_heads:
            raise ValueError("d_model must be a multiple of encoder_attention_heads")
        if self.n_window_infer % (2 * self.n_window):
            raise ValueError("n_window_infer must be a multiple of 2 * n_window")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniAudioConfig:
        """From a whole Omni, thinker or audio ``config.json`` dict (unknown keys ignored)."""
        d = d.get("thinker_config", d)
        d = d.get("audio_config", d)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None})


def mel_features(wave: torch.Tensor, num_mel_bins: int = 128) -> torch.Tensor:
    """The encoder's input ``[num_mel_bins, len(wave) // 160]`` for one 16 kHz mono clip: Whisper's
    log-mel over the clip itself (what the Qwen3-Omni processor's ``WhisperFeatureExtractor``
    call, ``padding=True``, computes for a clip alone; batched with a longer clip there, its
    last frames see zero padding instead of the reflected edge)."""
    return log_mel_spectrogram(wave, num_mel_bins, n_samples=wave.shape[-1])


def conv_length(frames: int | torch.Tensor) -> int | torch.Tensor:
    """Tokens of ``frames`` mel frames after three stride-2 convolutions (padding 1, kernel 3)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """How many thinker tokens (audio placeholders) a clip of ``frames`` mel frames becomes:
    13 per whole 100-frame chunk plus the remainder's."""
    chunk = 2 * n_window
    return (frames // chunk) * int(conv_length(chunk)) + int(conv_length(frames % chunk))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """``[length, channels]``: ``sin`` of position x timescale in the first half, ``cos`` in
    the second, timescales geometric from 1 to ``1 / max_timescale``."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        """``x [T, dim]``; ``windows``: lengths of the consecutive runs of rows that attend
        among themselves (bidirectionally)."""
        t, dim = x.shape
        q, k, v = (proj(x).view(t, self.heads, -1).transpose(0, 1) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = [F.scaled_dot_product_attention(qw, kw, vw)
               for qw, kw, vw in zip(q.split(windows, 1), k.split(windows, 1), v.split(windows, 1))]
        return self.out_proj(torch.cat(out, dim=1).transpose(0, 1).reshape(t, dim))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        dim = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = AudioAttention(dim, config.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, dim)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Qwen3OmniAudioEncoder(nn.Module):
    """Mel frames of a batch of clips -> their thinker embeddings (see the module docstring)."""

    def __init__(self, config: Qwen3OmniAudioConfig) -> None:
        super().__init__()
        self.config = config
        width = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, width, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(width, width, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(width, width, 3, 2, padding=1)
        self.conv_out = nn.Linear(width * int(conv_length(config.num_mel_bins)), config.d_model, bias=False)
        # float32, then the model's dtype: what building in float32 and casting gave
        table = sinusoids(config.max_source_positions, config.d_model).to(torch.get_default_dtype())
        self.register_buffer("positions", table, persistent=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.proj2 = nn.Linear(config.d_model, config.output_dim)

    def forward(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """``mels``: one ``[num_mel_bins, frames]`` tensor per clip; the clips' embeddings
        ``[audio_token_count(frames), output_dim]``, in order."""
        chunk = 2 * self.config.n_window
        chunks = [piece.T for mel in mels for piece in mel.split(chunk, dim=1)]
        lengths = [int(conv_length(c.shape[0])) for c in chunks]
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True).transpose(1, 2)[:, None]  # [N, 1, mel, time]
        h = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(padded.to(self.conv2d1.weight.dtype)))))))
        n, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f)) + self.positions[:t].to(h.dtype)
        x = torch.cat([rows[:length] for rows, length in zip(h, lengths)])
        windows = self._windows(mels)
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return list(x.split([audio_token_count(m.shape[1], self.config.n_window) for m in mels]))

    def _windows(self, mels: list[torch.Tensor]) -> list[int]:
        """Attention window lengths over the concatenated tokens: each clip's tokens in runs of
        ``n_window_infer / (2 n_window)`` chunks (counted at the longest chunk of the call's
        convolution output, as the reference), the remainder last."""
        config = self.config
        chunk = 2 * config.n_window
        longest = max(int(conv_length(min(chunk, m.shape[1] - start)))
                      for m in mels for start in range(0, m.shape[1], chunk))
        window = longest * (config.n_window_infer // chunk)
        out: list[int] = []
        for mel in mels:
            tokens = audio_token_count(mel.shape[1], config.n_window)
            out += [window] * (tokens // window) + ([tokens % window] if tokens % window else [])
        return out
