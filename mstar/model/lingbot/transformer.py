"""LingBot-World's causal DiT: Wan's blocks (``mstar.model.wan22.transformer``, diffusers
``WanTransformer3DModel`` names) with camera conditioning and block-causal self-attention.

Camera: the chunk's Plücker rays ``[B, 6 * 8 * 8, f, h, w]`` (one ray a pixel, a latent cell's
64 pixels as channels) are patchified like the latents and embedded once (a linear layer, then
a residual SiLU MLP); every block turns the embedding into a scale and a shift of its tokens,
``x = (1 + scale) * x + shift``, after self-attention and before cross-attention.

Causality: the DiT runs on one chunk of latent frames at a time. Its rotary frame positions
start at the chunk's absolute frame (``RollingKV.frames``) and its self-attention sees the
cached chunks before it (``RollingKV.attend_to``) plus itself. A ``commit`` forward (the clean
chunk at time 0) appends the chunk's keys and values to the cache. Without a cache the DiT
attends over its whole input, under ``mask`` when given (``cache.block_causal_mask``).

Numerics follow the Wan reference as the Wan2.2 port does: the modulation arithmetic and the
norms in float32; the camera layers run in the weights' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.lingbot.cache import RollingKV
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.wan22.transformer import ConditionEmbedder, Rope, WanBlock, WanRope, layer_norm32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention on ``[B, S, H, D]`` queries over ``[B, M, H, D]`` keys; ``mask [S, M]``
    bool, True where a query may attend."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


class CameraEmbedding(nn.Module):
    """Patchified Plücker rays -> the width, plus a residual SiLU MLP (the reference's
    ``patch_embedding_wancamctrl`` and ``c2ws_hidden_states_layer{1,2}``)."""

    def __init__(self, config: LingbotConfig) -> None:
        super().__init__()
        dim = config.dit.dim
        self.patch = config.dit.patch_size
        self.patch_embedding_wancamctrl = nn.Linear(config.camera_channels * math.prod(self.patch), dim)
        self.c2ws_hidden_states_layer1 = nn.Linear(dim, dim)
        self.c2ws_hidden_states_layer2 = nn.Linear(dim, dim)

    def forward(self, rays: torch.Tensor) -> torch.Tensor:
        """``[B, C, f, h, w]`` -> ``[B, N, dim]``; each token's features are ordered (channel,
        frame offset, row offset, column offset)."""
        b, c, f, h, w = rays.shape
        pt, ph, pw = self.patch
        x = rays.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        x = self.patch_embedding_wancamctrl(x.reshape(b, -1, c * pt * ph * pw))
        return x + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(x)))


class CausalWanBlock(WanBlock):
    """Wan's block with the camera's scale and shift after self-attention, and self-attention
    over the rolling cache."""

    def __init__(self, config: LingbotConfig) -> None:
        super().__init__(config.dit)
        dim = config.dit.dim
        self.cam_injector_layer1 = nn.Linear(dim, dim)
        self.cam_injector_layer2 = nn.Linear(dim, dim)
        self.cam_scale_layer = nn.Linear(dim, dim)
        self.cam_shift_layer = nn.Linear(dim, dim)

    def camera(self, x: torch.Tensor, camera: torch.Tensor) -> torch.Tensor:
        hidden = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(camera))) + camera
        return (1.0 + self.cam_scale_layer(hidden)) * x + self.cam_shift_layer(hidden)

    def forward(self, x: torch.Tensor, context: torch.Tensor, time: torch.Tensor, rope: Rope,  # type: ignore[override]
                camera: torch.Tensor | None = None, cache: RollingKV | None = None, layer: int = 0,
                commit: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, N, D]``, ``context [B, L, D]``, ``time [B, 1, 6, D]``, ``camera [B, N, D]``."""
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + time.float()).unbind(2)
        h = (layer_norm32(x, self.norm1) * (1 + scale) + shift).type_as(x)
        q, k, v = self.attn1.project(h, rope=rope)
        keys, values = (k, v) if cache is None else cache.attend_to(layer, k, v)
        if commit and cache is not None:
            cache.commit(layer, k, v)
        y = self.attn1.to_out[0](attention(q, keys, values, mask).flatten(2).type_as(q))
        x = (x.float() + y * gate).type_as(x)
        if camera is not None:
            x = self.camera(x, camera)
        h = x if self.norm2 is None else layer_norm32(x, self.norm2).type_as(x)
        x = x + self.attn2(h, context)
        h = (layer_norm32(x, self.norm3) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


class LingbotTransformer(nn.Module):
    """The causal DiT; the Wan parts carry diffusers ``WanTransformer3DModel`` names (the
    checkpoint loader renames the reference's), the camera parts the reference's."""

    def __init__(self, config: LingbotConfig) -> None:
        super().__init__()
        self.config = config
        dit = config.dit
        dim, patch = dit.dim, dit.patch_size
        self.rope = WanRope(dit)
        self.patch_embedding = nn.Conv3d(dit.in_channels, dim, kernel_size=patch, stride=patch)
        self.condition_embedder = ConditionEmbedder(dit)
        self.camera_embedder = CameraEmbedding(config)
        self.blocks = nn.ModuleList(CausalWanBlock(config) for _ in range(dit.num_layers))
        self.norm_out = nn.LayerNorm(dim, dit.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, dit.out_channels * math.prod(patch))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def new_cache(self) -> RollingKV:
        return RollingKV(len(self.blocks), self.config.window_frames, self.config.sink_frames)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, camera: torch.Tensor | None = None,
                cache: RollingKV | None = None, commit: bool = False,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """One evaluation on a chunk. ``x [B, in_channels, f, h, w]`` (the noisy latents then the
        condition channels); ``t [B]`` the time x 1000; ``text [B, L, text_dim]``; ``camera [B,
        camera_channels, f, h, w]`` or None. With ``cache`` the chunk follows the cached frames
        (``commit``: append it). Returns the flow ``[B, out_channels, f, h, w]``."""
        b, _, frames, height, width = x.shape
        pt, ph, pw = self.config.dit.patch_size
        grid = (frames // pt, height // ph, width // pw)
        if cache is not None and cache.frame_tokens is None:
            cache.frame_tokens = grid[1] * grid[2]
        first = 0 if cache is None else cache.frames
        rope = self.rope(grid, first_frame=first)
        tokens = self.patch_embedding(x).flatten(2).transpose(1, 2)
        temb, time = self.condition_embedder.time(t.reshape(b, 1), text.dtype)
        context = self.condition_embedder.text_embedder(text)
        cam = None if camera is None else self.camera_embedder(camera.to(tokens.dtype))
        for layer, block in enumerate(self.blocks):
            tokens = block(tokens, context, time, rope, cam, cache, layer, commit, mask)
        if commit and cache is not None:
            cache.frames += grid[0]
        shift, scale = (self.scale_shift_table[:, None] + temb[:, :, None]).unbind(2)
        tokens = (layer_norm32(tokens, self.norm_out) * (1 + scale) + shift).type_as(tokens)
        out = self.proj_out(tokens).reshape(b, *grid, pt, ph, pw, -1)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, frames, height, width)
