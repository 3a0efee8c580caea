"""The decoding half of the SNAC codec: codes -> quantized latent -> 24 kHz (or other) audio.

``SnacDecoder`` holds only what decoding needs: the per-level codebooks and ``out_proj``
projections of the residual quantizer, and the convolutional decoder. Parameter names equal
the keys of the reference ``snac.SNAC`` state dict (weight norm kept as torch's
``parametrizations.weight.original0/1``), so a reference checkpoint loads by name once its
encoder and quantizer ``in_proj`` tensors are dropped (``load_snac_state_dict``).

Noise: with ``config.noise`` every decoder block holds a learned ``NoiseBlock`` that adds
``randn(B, 1, T) * linear(x)``. The reference draws from torch's global generator;
``SnacDecoder.decode`` makes the source explicit: ``noise=False`` skips the blocks (a
deterministic decode, also consistent across overlapping streaming windows), and with
``noise=True`` draws come from ``generator`` or, when that is ``None``, from the global
generator in the reference's order (same shapes, same sequence), so under the same seed the
output equals the reference's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from mstar.layers.rotary import cos_sin_tables, rotate
from mstar.model.snac.config import SnacConfig
from mstar.model.weights import WeightLoadError

__all__ = ["ORPHEUS_TOKENS_PER_FRAME", "SnacDecoder", "codes_from_orpheus", "load_snac_state_dict"]

ORPHEUS_TOKENS_PER_FRAME = 7
"""Orpheus emits one coarse, two middle and four fine SNAC codes per frame."""


def _wn_conv(*args: int, **kwargs: int | bool) -> nn.Conv1d:
    return weight_norm(nn.Conv1d(*args, **kwargs))  # type: ignore[arg-type]


def _wn_conv_transpose(*args: int, **kwargs: int) -> nn.ConvTranspose1d:
    return weight_norm(nn.ConvTranspose1d(*args, **kwargs))


class Snake1d(nn.Module):
    """Snake activation ``x + sin(alpha * x)^2 / alpha`` with a learned per-channel alpha."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """Snake -> dilated conv (k=7) -> Snake -> 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int, groups: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            _wn_conv(dim, dim, 7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake1d(dim),
            _wn_conv(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2  # 0 with the "same" padding used here
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class NoiseBlock(nn.Module):
    """Adds ``n * linear(x)`` with ``n ~ N(0, 1)`` of shape ``[B, 1, T]`` (shared by channels)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = _wn_conv(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, _, t = x.shape
        n = torch.randn((b, 1, t), generator=generator, device=x.device, dtype=x.dtype)
        return x + n * self.linear(x)


class DecoderBlock(nn.Module):
    """Snake -> transposed conv upsampling by ``stride`` -> [noise] -> 3 residual units."""

    def __init__(self, in_dim: int, out_dim: int, stride: int, noise: bool, groups: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Snake1d(in_dim),
            _wn_conv_transpose(
                in_dim,
                out_dim,
                kernel_size=2 * stride,
                stride=stride,
                padding=math.ceil(stride / 2),
                output_padding=stride % 2,
            ),
        ]
        if noise:
            layers.append(NoiseBlock(out_dim))
        layers += [ResidualUnit(out_dim, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(
        self, x: torch.Tensor, noise: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        for layer in self.block:
            if isinstance(layer, NoiseBlock):
                if noise:
                    x = layer(x, generator)
            else:
                x = layer(x)
        return x


class LocalAttention(nn.Module):
    """Pre-norm multi-head self-attention within non-overlapping windows of ``window_size``
    steps, with rotary position embeddings (restarting in every window), plus the input."""

    def __init__(self, dim: int, window_size: int, head_dim: int = 64) -> None:
        super().__init__()
        self.window_size = window_size
        self.head_dim = head_dim
        self.heads = dim // head_dim
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.rel_pos = _RotaryFrequencies(head_dim)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        w = self.window_size
        if t % w:
            raise ValueError(f"latent length {t} is not a multiple of attn_window_size {w}")
        h = self.norm(x.transpose(1, 2))
        # [B, T, C] -> [B, heads, windows, w, head_dim]
        q, k, v = (
            part.reshape(b, t // w, w, self.heads, self.head_dim).permute(0, 3, 1, 2, 4)
            for part in self.to_qkv(h).chunk(3, dim=-1)
        )
        inv_freq = self.rel_pos.inv_freq
        cos, sin = cos_sin_tables(torch.outer(torch.arange(w, device=x.device, dtype=inv_freq.dtype), inv_freq),
                                  q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, t, c)
        return self.to_out(out).transpose(1, 2) + x


class _RotaryFrequencies(nn.Module):
    """Holds ``inv_freq`` (a persistent buffer in the reference state dict)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq)


class Decoder(nn.Module):
    """Latent ``[B, latent_dim, T]`` -> audio ``[B, 1, T * prod(rates)]`` in (-1, 1)."""

    def __init__(self, config: SnacConfig) -> None:
        super().__init__()
        latent, dim = config.resolved_latent_dim, config.decoder_dim
        layers: list[nn.Module]
        if config.depthwise:
            layers = [
                _wn_conv(latent, latent, 7, padding=3, groups=latent),
                _wn_conv(latent, dim, 1),
            ]
        else:
            layers = [_wn_conv(latent, dim, 7, padding=3)]
        if config.attn_window_size is not None:
            layers.append(LocalAttention(dim, config.attn_window_size))
        out_dim = dim
        for i, stride in enumerate(config.decoder_rates):
            in_dim, out_dim = dim // 2**i, dim // 2 ** (i + 1)
            groups = out_dim if config.depthwise else 1
            layers.append(DecoderBlock(in_dim, out_dim, stride, config.noise, groups))
        layers += [Snake1d(out_dim), _wn_conv(out_dim, 1, 7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(
        self, x: torch.Tensor, noise: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        for layer in self.model:
            x = layer(x, noise, generator) if isinstance(layer, DecoderBlock) else layer(x)
        return x


class CodebookLevel(nn.Module):
    """One quantizer level's decode path: code -> codebook vector -> ``out_proj`` -> upsample."""

    def __init__(self, latent_dim: int, codebook_size: int, codebook_dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.out_proj = _wn_conv(codebook_dim, latent_dim, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(F.embedding(codes, self.codebook.weight).transpose(1, 2))
        return z.repeat_interleave(self.stride, dim=-1)


class ResidualCodebooks(nn.Module):
    """The residual quantizer's decode path: the latent is the sum of all levels' vectors."""

    def __init__(self, config: SnacConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(
            CodebookLevel(
                config.resolved_latent_dim, config.codebook_size, config.codebook_dim, stride
            )
            for stride in config.vq_strides
        )

    def from_codes(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """``codes[i]`` ``[B, T_i]`` -> latent ``[B, latent_dim, T_i * stride_i]``."""
        z = self.quantizers[0](codes[0])
        for level, c in zip(self.quantizers[1:], codes[1:], strict=True):
            z = z + level(c)
        return z


class SnacDecoder(nn.Module):
    """SNAC codes -> waveform. Load weights with ``load_snac_state_dict``."""

    def __init__(self, config: SnacConfig | None = None) -> None:
        super().__init__()
        self.config = config or SnacConfig()
        self.quantizer = ResidualCodebooks(self.config)
        self.decoder = Decoder(self.config)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @property
    def samples_per_frame(self) -> int:
        """Output samples per coarsest-level code (2048 at 24 kHz)."""
        return self.config.samples_per_frame

    def check_codes(self, codes: Sequence[torch.Tensor]) -> int:
        """Validate code shapes; return the latent length ``T_0 * vq_strides[0]``."""
        strides = self.config.vq_strides
        if len(codes) != len(strides):
            raise ValueError(f"expected {len(strides)} code levels, got {len(codes)}")
        batch, latent_len = codes[0].shape[0], codes[0].shape[-1] * strides[0]
        for i, (c, s) in enumerate(zip(codes, strides)):
            if c.dim() != 2 or c.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"codes[{i}] must be int [B, T], got {c.dtype} {tuple(c.shape)}")
            if c.shape[0] != batch or c.shape[1] * s != latent_len:
                raise ValueError(
                    f"codes[{i}] has shape {tuple(c.shape)}; expected [{batch}, {latent_len // s}]"
                )
        if latent_len == 0:
            raise ValueError("empty code sequence")
        return latent_len

    def codes_to_latent(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """The quantized latent ``[B, latent_dim, T_0 * vq_strides[0]]``."""
        self.check_codes(codes)
        return self.quantizer.from_codes(codes)

    def decode(
        self,
        codes: Sequence[torch.Tensor],
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Decode ``codes[i]`` ``[B, T_i]`` to audio ``[B, 1, T_0 * samples_per_frame]``.

        ``noise=False`` skips the NoiseBlocks (deterministic). With ``noise=True`` the noise is
        drawn from ``generator`` (on the model's device) or from torch's global generator.
        """
        return self.decoder(self.codes_to_latent(codes), noise, generator)

    forward = decode

    def fuse_weight_norm(self) -> SnacDecoder:
        """Fold weight-norm parametrisations into plain weights (faster inference). Call after
        loading: a fused module's state dict no longer matches the reference keys. Do not fuse
        a ``copy.deepcopy`` of a loaded decoder: torch's parametrized classes are shared with the
        original, which would lose its weights; build and load a fresh instance instead."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self


def codes_from_orpheus(
    tokens: Sequence[int] | torch.Tensor,
    *,
    codebook_size: int = 4096,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Split Orpheus audio codes (offsets already removed) into SNAC's three levels.

    Each frame of 7 is laid out ``[l0, l1a, l2a, l2b, l1b, l2c, l2d]`` (Orpheus's decoder):
    ``c0 = t[0]``, ``c1 = [t[1], t[4]]``, ``c2 = [t[2], t[3], t[5], t[6]]``. Returns int64
    tensors of shapes ``[1, N]``, ``[1, 2N]``, ``[1, 4N]`` for ``N`` frames.
    """
    t = torch.as_tensor(tokens, dtype=torch.int64, device=device).reshape(-1)
    if t.numel() == 0 or t.numel() % ORPHEUS_TOKENS_PER_FRAME:
        raise ValueError(f"need a positive multiple of 7 tokens, got {t.numel()}")
    if bool(((t < 0) | (t >= codebook_size)).any()):
        raise ValueError(f"Orpheus codes must lie in [0, {codebook_size})")
    frames = t.view(-1, ORPHEUS_TOKENS_PER_FRAME)
    return [frames[:, cols].reshape(1, -1) for cols in ([0], [1, 4], [2, 3, 5, 6])]


_LEGACY_WEIGHT_NORM = {"weight_g": "parametrizations.weight.original0",
                       "weight_v": "parametrizations.weight.original1"}
_SKIPPED = re.compile(r"^(encoder\.|quantizer\.quantizers\.\d+\.in_proj\.)")
_MAX_LISTED = 8


def _listed(names: Sequence[str]) -> str:
    more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def load_snac_state_dict(module: SnacDecoder, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Load a full reference ``snac.SNAC`` state dict into ``module`` and return the skipped keys.

    Encoder and quantizer ``in_proj`` tensors are skipped on purpose; legacy weight-norm keys
    (``weight_g``/``weight_v``) are renamed to torch's parametrisation keys. Any decoder tensor
    missing, any other unexpected key, or any shape mismatch raises ``WeightLoadError``.
    """
    kept: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for key, tensor in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf in _LEGACY_WEIGHT_NORM:
            key = f"{prefix}.{_LEGACY_WEIGHT_NORM[leaf]}"
        if _SKIPPED.match(key):
            skipped.append(key)
        else:
            kept[key] = tensor
    expected = module.state_dict()
    missing = sorted(set(expected) - set(kept))
    if missing:
        raise WeightLoadError(f"SNAC checkpoint lacks decoder tensors: {_listed(missing)}")
    unexpected = sorted(set(kept) - set(expected))
    if unexpected:
        raise WeightLoadError(f"unexpected SNAC checkpoint tensors: {_listed(unexpected)}")
    bad = [f"{k} {tuple(kept[k].shape)} != {tuple(v.shape)}"
           for k, v in expected.items() if kept[k].shape != v.shape]
    if bad:
        raise WeightLoadError(f"SNAC checkpoint shape mismatch: {_listed(bad)}")
    module.load_state_dict(kept, strict=True)
    return skipped
