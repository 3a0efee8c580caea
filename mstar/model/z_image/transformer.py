"""Z-Image's single-stream diffusion transformer (the denoiser of Z-Image / Z-Image-Turbo).

Parameter names equal the keys of diffusers' ``ZImageTransformer2DModel`` state dict (diffusers
0.42.1), so a checkpoint's ``transformer/`` folder loads by name. The maths, per request:

* the latent image ``[C, H, W]`` is cut into ``p x p`` patches (row-major tokens, channels
  ordered ``(dy, dx, c)``), embedded, and padded to a multiple of 32 tokens with a learned pad
  token; the caption features ``[n, cap_feat_dim]`` are RMS-normed, embedded and padded the same
  way with their own pad token. Pad tokens take part in attention like real ones;
* 3-axis rotary positions ``(frame, row, column)``: caption token ``j`` (pad included) sits at
  ``(1 + j, 0, 0)``, image token ``(r, c)`` at ``(1 + padded caption length, r, c)``, image pad
  tokens at ``(0, 0, 0)``. Rotation acts on adjacent channel pairs;
* ``n_refiner_layers`` timestep-modulated blocks refine the image tokens alone, as many
  unmodulated blocks the caption alone; then ``n_layers`` modulated blocks run over the joined
  sequence ``[image, caption]``; a modulated final layer maps image tokens back to patches;
* every block is pre- and post-normed (RMSNorm around attention and around the SwiGLU MLP);
  modulation from the timestep embedding gives a scale on the pre-norm and a tanh gate on the
  residual branch.

A batch may mix caption lengths (and image sizes): sequences are padded to the longest and the
padding is masked out of attention, so each request's output does not depend on its batch.
The DiT's time runs from 0 (noise) to 1 (image): ``t = 1 - sigma``, and its output is the
negated flow velocity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from mstar.layers.norm import RMSNorm
from mstar.layers.rotary import apply_rotary_pairs, axis_angles
from mstar.model.z_image.config import SEQ_MULTIPLE, ZImageTransformerConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [..., L, head_dim / 2], float32

__all__ = ["ZImageBlock", "ZImageTransformer", "rope_cos_sin"]


def padded_length(n: int) -> int:
    return n + (-n) % SEQ_MULTIPLE


def rope_cos_sin(positions: torch.Tensor, axes_dims: Sequence[int], theta: float) -> Rope:
    """Rotary tables for integer positions ``[L, 3]``: ``(cos, sin)`` ``[L, sum(axes_dims) / 2]``, one
    angle per channel pair; the angles are formed in float64 and rounded to float32 before
    cos/sin, as diffusers' table does."""
    angle = axis_angles(positions, axes_dims, theta).float()
    return angle.cos(), angle.sin()


class TimestepEmbedder(nn.Module):
    """Sinusoidal features (``[cos, sin]``, 256 of them) of a scalar time -> MLP."""

    def __init__(self, out_dim: int, mid_dim: int = 1024, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, mid_dim), nn.SiLU(), nn.Linear(mid_dim, out_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class ZImageAttention(nn.Module):
    """Multi-head self-attention with per-head RMSNorm on q and k, then RoPE; no biases."""

    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])
        self.norm_q = RMSNorm(dim // heads, eps=1e-5) if qk_norm else None
        self.norm_k = RMSNorm(dim // heads, eps=1e-5) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None) -> torch.Tensor:
        """``x [B, L, dim]``; ``mask [B, L]`` (True = a real token) or None when nothing is padded."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rotary_pairs(q, *rope), apply_rotary_pairs(k, *rope)
        keys = None if mask is None else mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keys)
        return self.to_out[0](out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (diffusers' names)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """Sandwich-normed attention and MLP, optionally modulated by the timestep embedding."""

    def __init__(self, config: ZImageTransformerConfig, modulation: bool) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        self.attention = ZImageAttention(dim, config.n_heads, config.qk_norm)
        self.feed_forward = FeedForward(dim, config.ffn_dim)
        self.attention_norm1 = RMSNorm(dim, eps)
        self.attention_norm2 = RMSNorm(dim, eps)
        self.ffn_norm1 = RMSNorm(dim, eps)
        self.ffn_norm2 = RMSNorm(dim, eps)
        self.adaLN_modulation = nn.Sequential(nn.Linear(config.adaln_dim, 4 * dim)) if modulation else None

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
                adaln: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, L, dim]``; ``adaln [B, adaln_dim]`` (the timestep embedding) for modulated blocks."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_attn, gate_attn, scale_mlp, gate_mlp = self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_attn), rope, mask)
        x = x + gate_attn.tanh() * self.attention_norm2(attn)
        mlp = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp))
        return x + gate_mlp.tanh() * self.ffn_norm2(mlp)


class FinalLayer(nn.Module):
    """Non-affine LayerNorm scaled by ``1 + Linear(silu(t_emb))``, then the patch projection."""

    def __init__(self, dim: int, adaln_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(adaln_dim, dim))

    def forward(self, x: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.adaLN_modulation(adaln)
        return self.linear(self.norm_final(x) * scale.unsqueeze(1))


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """``[C, H, W]`` -> row-major tokens ``[H/p * W/p, p * p * C]`` (channels ``(dy, dx, c)``)."""
    c, h, w = image.shape
    patches = image.view(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)
    return patches.reshape((h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, p: int) -> torch.Tensor:
    """Inverse of ``patchify``: ``[rows * cols, p * p * C]`` -> ``[C, rows * p, cols * p]``."""
    grid = tokens.view(rows, cols, p, p, -1).permute(4, 0, 2, 1, 3)
    return grid.reshape(grid.shape[0], rows * p, cols * p)


def _pad_rows(x: torch.Tensor, length: int, pad_token: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, pad_token.to(x.dtype).expand(length - len(x), -1)]) if length > len(x) else x


def _batch(seqs: list[torch.Tensor], ropes: list[Rope]) -> tuple[torch.Tensor, Rope, torch.Tensor | None]:
    """Pad per-request sequences to one batch; the mask (None if all lengths agree) marks real rows."""
    lengths = torch.tensor([len(s) for s in seqs])
    x = pad_sequence(seqs, batch_first=True)
    rope = tuple(pad_sequence([r[i] for r in ropes], batch_first=True) for i in range(2))
    if bool((lengths == x.shape[1]).all()):
        return x, rope, None
    return x, rope, (torch.arange(x.shape[1])[None] < lengths[:, None]).to(x.device)


class ZImageTransformer(nn.Module):
    """The Z-Image DiT with diffusers' ``ZImageTransformer2DModel`` parameter names."""

    def __init__(self, config: ZImageTransformerConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or ZImageTransformerConfig()
        c = cfg.in_channels
        sizes = list(zip(cfg.all_patch_size, cfg.all_f_patch_size))
        self.all_x_embedder = nn.ModuleDict(
            {f"{p}-{f}": nn.Linear(f * p * p * c, cfg.dim) for p, f in sizes})
        self.all_final_layer = nn.ModuleDict(
            {f"{p}-{f}": FinalLayer(cfg.dim, cfg.adaln_dim, f * p * p * c) for p, f in sizes})
        self.t_embedder = TimestepEmbedder(cfg.adaln_dim)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, cfg.norm_eps), nn.Linear(cfg.cap_feat_dim, cfg.dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.noise_refiner = nn.ModuleList(ZImageBlock(cfg, modulation=True) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(ZImageBlock(cfg, modulation=False) for _ in range(cfg.n_refiner_layers))
        self.layers = nn.ModuleList(ZImageBlock(cfg, modulation=True) for _ in range(cfg.n_layers))

    def rope(self, positions: torch.Tensor) -> Rope:
        limits = torch.tensor(self.config.axes_lens, device=positions.device)
        if bool((positions >= limits).any()):
            raise ValueError(f"rotary positions exceed axes_lens {self.config.axes_lens}: caption or image too large")
        return rope_cos_sin(positions, self.config.axes_dims, self.config.rope_theta)

    def forward(self, latents: torch.Tensor | Sequence[torch.Tensor], t: torch.Tensor,
                captions: Sequence[torch.Tensor], patch_size: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        """One DiT evaluation for a batch of requests.

        ``latents``: ``[B, C, H, W]`` or a list of ``[C, H, W]`` (sizes may differ); ``t [B]``: the
        DiT's time in ``[0, 1]`` (0 = pure noise); ``captions``: per request ``[n_i, cap_feat_dim]``
        (real tokens only). Returns the output in the form of ``latents``."""
        stacked = isinstance(latents, torch.Tensor)
        images = list(latents.unbind(0)) if stacked else list(latents)
        if not len(images) == len(captions) == len(t):
            raise ValueError(f"{len(images)} latents, {len(captions)} captions and {len(t)} timesteps")
        p = patch_size or self.config.all_patch_size[0]
        key = f"{p}-1"
        if key not in self.all_x_embedder:
            raise ValueError(f"no embedder for patch size {p} (have {list(self.all_x_embedder)})")
        device = images[0].device
        adaln = self.t_embedder(t * self.config.t_scale).type_as(images[0])

        cap_lens = [len(cap) for cap in captions]
        cap_padded = [padded_length(n) for n in cap_lens]
        cap = self.cap_embedder(torch.cat(list(captions)).to(images[0].dtype))
        cap_seqs = [_pad_rows(x, n, self.cap_pad_token) for x, n in zip(cap.split(cap_lens), cap_padded)]
        cap_ropes = [self.rope(_caption_positions(n, device)) for n in cap_padded]

        grids = [(img.shape[1] // p, img.shape[2] // p) for img in images]
        img_lens = [rows * cols for rows, cols in grids]
        img_padded = [padded_length(n) for n in img_lens]
        x = self.all_x_embedder[key](torch.cat([patchify(img, p) for img in images]))
        img_seqs = [_pad_rows(s, n, self.x_pad_token) for s, n in zip(x.split(img_lens), img_padded)]
        img_ropes = [self.rope(_image_positions(grid, n, frame, device))
                     for grid, n, frame in zip(grids, img_padded, (n + 1 for n in cap_padded))]

        x, rope, mask = _batch(img_seqs, img_ropes)
        for layer in self.noise_refiner:
            x = layer(x, rope, mask, adaln)
        cap, rope, mask = _batch(cap_seqs, cap_ropes)
        for layer in self.context_refiner:
            cap = layer(cap, rope, mask)

        joined = [torch.cat([x[i, :ni], cap[i, :nc]]) for i, (ni, nc) in enumerate(zip(img_padded, cap_padded))]
        joined_ropes = [tuple(torch.cat([ri[k], rc[k]]) for k in range(2)) for ri, rc in zip(img_ropes, cap_ropes)]
        x, rope, mask = _batch(joined, joined_ropes)
        for layer in self.layers:
            x = layer(x, rope, mask, adaln)
        x = self.all_final_layer[key](x, adaln)

        out = [unpatchify(x[i, :n], rows, cols, p) for i, (n, (rows, cols)) in enumerate(zip(img_lens, grids))]
        return torch.stack(out) if stacked else out


def _caption_positions(length: int, device: torch.device) -> torch.Tensor:
    """Caption token ``j`` (pad tokens included) at ``(1 + j, 0, 0)``."""
    positions = torch.zeros(length, 3, dtype=torch.int64, device=device)
    positions[:, 0] = torch.arange(1, length + 1, device=device)
    return positions


def _image_positions(grid: tuple[int, int], length: int, frame: int, device: torch.device) -> torch.Tensor:
    """Image tokens at ``(frame, row, column)`` row-major, pad tokens after them at ``(0, 0, 0)``."""
    rows, cols = grid
    positions = torch.zeros(length, 3, dtype=torch.int64, device=device)
    positions[: rows * cols, 0] = frame
    positions[: rows * cols, 1] = torch.arange(rows, device=device).repeat_interleave(cols)
    positions[: rows * cols, 2] = torch.arange(cols, device=device).repeat(rows)
    return positions
