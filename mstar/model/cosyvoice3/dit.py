"""CosyVoice3's flow velocity estimator: a DiT over mel frames (F5-TTS's backbone, made causal).

Per frame, the noisy mel ``x``, the prompt mel ``cond`` (zero past the prompt), the upsampled
token features ``mu`` and the speaker vector are concatenated and projected to the model width;
a convolutional position embedding (two grouped convolutions padded on the left only, Mish
after each) is added. The flow time goes through sinusoidal features and a two-layer MLP. Each
block is adaLN-Zero: from the time embedding a linear layer makes a shift, scale and gate for
the attention and for the feed-forward (tanh-GELU); the norms are LayerNorms without affine
weights. A final adaptive norm (scale, then shift) and a projection give the velocity.

Attention is rotary, with one quirk of the reference kept exactly: the rotation (interleaved
pairs, x-transformers' convention) is applied to q and k before they are split into heads, over
the first ``head_dim`` channels only, so only the first head sees positions; the others rely on
the convolutional position embedding.

Streaming (``streaming=True``) restricts each query to keys up to the end of its chunk of
``static_chunk_size`` frames (the reference passes no left-chunk limit). Every other part is
per-frame or causal, so the velocity of a frame depends on no frame past its chunk: decoding a
prefix of whole chunks gives the prefix of the whole streaming decode. Without streaming every
valid frame attends to every valid frame.

``forward(x, mask, cond_stack, t, streaming)`` has ``FlowEstimator``'s signature (the stack is
``FlowEstimator.conditioning(mu, spks, cond)``), so ``mstar.model.flow.solve_euler`` and the
denoise engine's ``velocity_fn`` drive either estimator. Names follow the released ``flow.pt``
under ``decoder.estimator.`` through ``checkpoint.dit_name_map``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.flow.estimator import chunk_attention_mask, timestep_features

__all__ = ["DiTConfig", "DiTEstimator", "rotate_first_head"]


@dataclass(frozen=True)
class DiTConfig:
    """The defaults are Fun-CosyVoice3-0.5B's ``flow.decoder.estimator`` (``cosyvoice3.yaml``)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    head_dim: int = 64
    ff_mult: int = 2
    mel_channels: int = 80  # x, cond and the output
    mu_channels: int = 80
    speaker_channels: int = 80
    time_features: int = 256  # sinusoidal features of the flow time
    pos_kernel: int = 31
    pos_groups: int = 16
    static_chunk_size: int = 50  # frames: 25 tokens x token_mel_ratio 2
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.pos_kernel % 2 == 0:
            raise ValueError(f"pos_kernel must be odd, got {self.pos_kernel}")
        if self.dim % self.pos_groups:
            raise ValueError(f"dim ({self.dim}) must be a multiple of pos_groups ({self.pos_groups})")

    @property
    def input_channels(self) -> int:
        return 2 * self.mel_channels + self.mu_channels + self.speaker_channels


def rotate_first_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, T, heads * head_dim]`` over its first
    ``head_dim`` channels (``cos`` and ``sin`` ``[T, head_dim]`` fp32, each frequency repeated for
    the two channels of its pair), computed in fp32 as the reference does; the other channels
    pass unchanged."""
    width = cos.shape[-1]
    head, rest = x[..., :width].float(), x[..., width:]
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat(((head * cos + turned * sin).to(x.dtype), rest), dim=-1)


class CausalPositionConv(nn.Module):
    """Two grouped convolutions over frames, each left-padded and followed by Mish."""

    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(dim, dim, kernel, groups=groups)
        self.conv2 = nn.Conv1d(dim, dim, kernel, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, dim]`` -> ``[B, T, dim]``."""
        h = x.transpose(1, 2)
        for conv in (self.conv1, self.conv2):
            h = F.mish(conv(F.pad(h, (conv.kernel_size[0] - 1, 0))))
        return h.transpose(1, 2)


class DiTAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, valid: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``allowed`` ``[B, T, T]`` keys per query; ``valid`` ``[B, T, 1]`` zeroes padded rows."""
        b, t, _ = x.shape
        q = rotate_first_head(self.to_q(x), *rope)
        k = rotate_first_head(self.to_k(x), *rope)
        q, k, v = (h.view(b, t, self.heads, self.head_dim).transpose(1, 2) for h in (q, k, self.to_v(x)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.to_out(out.transpose(1, 2).reshape(b, t, -1)) * valid


class DiTBlock(nn.Module):
    """adaLN-Zero: ``x + gate_a * attn(norm(x) * (1 + scale_a) + shift_a)``, then the same
    around the feed-forward, shift/scale/gate from ``modulation(silu(time))``."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        c = config
        self.modulation = nn.Linear(c.dim, 6 * c.dim)
        self.attn = DiTAttention(c.dim, c.heads, c.head_dim)
        self.ff_in = nn.Linear(c.dim, c.ff_mult * c.dim)
        self.ff_out = nn.Linear(c.ff_mult * c.dim, c.dim)

    def forward(self, x: torch.Tensor, time: torch.Tensor, allowed: torch.Tensor, valid: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = self.modulation(F.silu(time))[:, None].chunk(6, dim=-1)
        h = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_a) + shift_a
        x = x + gate_a * self.attn(h, allowed, valid, rope)
        h = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_f) + shift_f
        return x + gate_f * self.ff_out(F.gelu(self.ff_in(h), approximate="tanh"))


class DiTEstimator(nn.Module):
    """``forward(x, mask, cond_stack, t)``: the flow velocity ``[B, mel, T]`` of noisy mel ``x``
    ``[B, mel, T]`` at flow time ``t`` [B], given the conditioning stack ``[B, mu + speaker +
    mel, T]`` and the frame mask ``[B, 1, T]``. Padded frames' outputs are not zeroed (the
    reference leaves them too); callers read valid frames only."""

    def __init__(self, config: DiTConfig = DiTConfig()) -> None:
        super().__init__()
        self.config = config
        c = config
        self.time_in = nn.Linear(c.time_features, c.dim)
        self.time_out = nn.Linear(c.dim, c.dim)
        self.input_proj = nn.Linear(c.input_channels, c.dim)
        self.pos_conv = CausalPositionConv(c.dim, c.pos_kernel, c.pos_groups)
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("rotary_inv_freq", inv_freq)  # released as rotary_embed.inv_freq
        self.blocks = nn.ModuleList(DiTBlock(c) for _ in range(c.depth))
        self.final_modulation = nn.Linear(c.dim, 2 * c.dim)
        self.proj_out = nn.Linear(c.dim, c.mel_channels)

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_out(F.silu(self.time_in(timestep_features(t, self.config.time_features))))

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[T, head_dim]`` of positions ``0 .. T-1`` (fp32, as the
        reference computes them outside autocast)."""
        inv_freq = self.rotary_inv_freq.float()
        pos = torch.arange(length, device=inv_freq.device, dtype=torch.float32)
        angles = (pos[:, None] * inv_freq[None]).repeat_interleave(2, dim=-1)
        return angles.cos(), angles.sin()

    def embed_inputs(self, x: torch.Tensor, cond_stack: torch.Tensor) -> torch.Tensor:
        """``[B, T, dim]`` from ``x`` and the stack, both channels-first."""
        c = self.config
        mu, spks, cond = cond_stack.split([c.mu_channels, c.speaker_channels, c.mel_channels], dim=1)
        h = self.input_proj(torch.cat([x, cond, mu, spks], dim=1).transpose(1, 2))
        return self.pos_conv(h) + h

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor, t: torch.Tensor,
                streaming: bool = False) -> torch.Tensor:
        c = self.config
        time = self.time_embedding(t.expand(x.shape[0]) if t.ndim == 0 else t)
        h = self.embed_inputs(x, cond_stack)
        allowed = chunk_attention_mask(mask, c.static_chunk_size if streaming else 0)
        valid = mask.transpose(1, 2).bool()
        rope = self.rope(x.shape[-1])
        for block in self.blocks:
            h = block(h, time, allowed, valid, rope)
        scale, shift = self.final_modulation(F.silu(time))[:, None].chunk(2, dim=-1)
        h = F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale) + shift
        return self.proj_out(h).transpose(1, 2)
