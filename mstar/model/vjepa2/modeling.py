"""V-JEPA 2's modules: the ViT video encoder, the masked predictor and the action-conditioned
predictor, all pre-norm transformer blocks with 3D rotary attention.

Rotary positions: a token's position is (frame, row, column) on the tubelet grid. Each head's
first three slices of ``2 * (head_dim // 6)`` channels are rotated by the frame, row and column
index respectively; what is left over stays as it is. The rotation is the released one: channel
pairs ``(2i, 2i+1)`` are rotated, but the angle of output channel ``c`` is
``pos * 10000 ** (-(c mod d/2) / (d/2))`` (the released code's frequency layout, kept so the
weights mean what they were trained to mean).

Parameter names follow Hugging Face's ``VJEPA2Model`` (``encoder.*``, ``predictor.*``); the
official 2-AC checkpoint's names map onto them in ``checkpoint.py`` (its fused ``qkv`` is kept
as one projection: ``fused_qkv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.vjepa2.config import ACPredictorConfig, EncoderConfig, PredictorConfig


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x [..., N, d]`` rotated by positions ``pos`` (broadcast against ``x[..., N]``)."""
    d = x.shape[-1]
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=x.dtype, device=x.device) / (d / 2.0))
    angle = pos.to(x.dtype)[..., None] * omega
    cos, sin = angle.cos(), angle.sin()
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    return x * cos + turned * sin


def grid_positions(ids: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token index on a ``grid x grid`` frame grid -> (frame, row, column)."""
    per_frame = grid * grid
    frame = ids // per_frame
    rest = ids - frame * per_frame
    return frame, rest // grid, rest % grid


class Attention(nn.Module):
    """Multi-head self-attention with 3D rotary positions. ``fused_qkv``: one ``qkv`` projection
    (the official layout) instead of ``query``/``key``/``value`` (Hugging Face's)."""

    def __init__(self, dim: int, num_heads: int, *, bias: bool = True, fused_qkv: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not a multiple of {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.rope_dim = 2 * ((self.head_dim // 3) // 2)
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        else:
            self.query = nn.Linear(dim, dim, bias=bias)
            self.key = nn.Linear(dim, dim, bias=bias)
            self.value = nn.Linear(dim, dim, bias=bias)
        self.proj = nn.Linear(dim, dim)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            return q, k, v
        return tuple(p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                     for p in (self.query, self.key, self.value))  # type: ignore[return-value]

    def _rope(self, x: torch.Tensor, pos: tuple[torch.Tensor, ...], spatial: torch.Tensor | None) -> torch.Tensor:
        s = self.rope_dim
        frame, row, col = (p.unsqueeze(-2) for p in pos)  # [B|1, 1, N]: one per head
        parts = [rotate(x[..., :s], frame)]
        for i, p in ((1, row), (2, col)):
            seg = x[..., i * s:(i + 1) * s]
            turned = rotate(seg, p)
            parts.append(turned if spatial is None else torch.where(spatial[:, None], turned, seg))
        parts.append(x[..., 3 * s:])
        return torch.cat(parts, -1)

    def forward(self, x: torch.Tensor, pos: tuple[torch.Tensor, ...], *, spatial: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, N, dim]``; ``pos`` (frame, row, column), each ``[B|1, N]``; ``spatial [N]``: False
        for a token rotated by its frame only (2-AC's action and state tokens); ``mask [N, N]``:
        True where a query may attend to a key."""
        q, k, v = self._heads(x)
        q, k = self._rope(q, pos, spatial), self._rope(k, pos, spatial)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, int(dim * ratio))
        self.fc2 = nn.Linear(int(dim * ratio), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, eps: float, *, bias: bool = True,
                 fused_qkv: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attention = Attention(dim, num_heads, bias=bias, fused_qkv=fused_qkv)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_ratio)

    def forward(self, x: torch.Tensor, pos: tuple[torch.Tensor, ...], **attn) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), pos, **attn)
        return x + self.mlp(self.norm2(x))


class PatchEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        size = (config.tubelet_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_chans, config.hidden_size, kernel_size=size, stride=size)


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.patch_embeddings = PatchEmbeddings(config)


class VJEPA2Encoder(nn.Module):
    """Video ``[B, T, C, H, W]`` (``H == W == crop_size``, ``T`` a multiple of ``tubelet_size``)
    -> tokens ``[B, T / tubelet_size * grid^2, hidden]`` in (frame, row, column) order."""

    def __init__(self, config: EncoderConfig, *, fused_qkv: bool = False):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layer = nn.ModuleList(Block(config.hidden_size, config.num_heads, config.mlp_ratio,
                                         config.layer_norm_eps, bias=config.qkv_bias, fused_qkv=fused_qkv)
                                   for _ in range(config.num_layers))
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        c = self.config
        if video.shape[-2:] != (c.crop_size, c.crop_size):
            raise ValueError(f"frames must be {c.crop_size}x{c.crop_size}, got {tuple(video.shape[-2:])}")
        if video.shape[1] < c.tubelet_size:  # one frame: repeated to fill a tubelet
            video = video.repeat(1, c.tubelet_size, 1, 1, 1)
        proj = self.embeddings.patch_embeddings.proj
        x = proj(video.transpose(1, 2).to(proj.weight.dtype)).flatten(2).transpose(1, 2)
        pos = grid_positions(torch.arange(x.shape[1], device=x.device)[None], c.grid)
        for block in self.layer:
            x = block(x, pos)
        return self.layernorm(x)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, D]`` at ``index [B, M]`` -> ``[B, M, D]``."""
    return torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1]))


class PredictorEmbeddings(nn.Module):
    def __init__(self, encoder: EncoderConfig, config: PredictorConfig):
        super().__init__()
        self.predictor_embeddings = nn.Linear(encoder.hidden_size, config.hidden_size)
        self.mask_tokens = nn.Parameter(torch.zeros(config.num_mask_tokens, 1, 1, config.hidden_size))


class VJEPA2Predictor(nn.Module):
    """The masked predictor: the encoder's tokens at ``context [B, Nc]`` (token indices) and one
    learnt mask token at each of ``target [B, Nt]`` go through the blocks with their grid
    positions; the target tokens come out projected back to the encoder's width,
    ``[B, Nt, encoder hidden]``. Attention is unmasked, so token order does not matter (the
    reference sorts by position and back; we leave them in place)."""

    def __init__(self, encoder: EncoderConfig, config: PredictorConfig):
        super().__init__()
        self.grid = encoder.grid
        self.num_mask_tokens = config.num_mask_tokens
        self.embeddings = PredictorEmbeddings(encoder, config)
        self.layer = nn.ModuleList(Block(config.hidden_size, config.num_heads, config.mlp_ratio,
                                         encoder.layer_norm_eps, bias=encoder.qkv_bias)
                                   for _ in range(config.num_layers))
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=encoder.layer_norm_eps)
        self.proj = nn.Linear(config.hidden_size, encoder.hidden_size)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, target: torch.Tensor,
                mask_index: int = 1) -> torch.Tensor:
        emb = self.embeddings
        ctx = emb.predictor_embeddings(gather_tokens(hidden, context))
        token = emb.mask_tokens[mask_index % self.num_mask_tokens].view(1, 1, -1)
        x = torch.cat([ctx, token.expand(len(target), target.shape[1], -1).to(ctx.dtype)], 1)
        pos = grid_positions(torch.cat([context, target], 1), self.grid)
        for block in self.layer:
            x = block(x, pos)
        return self.proj(self.layernorm(x)[:, context.shape[1]:])


class VJEPA2ACPredictor(nn.Module):
    """The action-conditioned predictor (official names, ``attn`` read as ``attention``): the
    encoder's tokens of ``T`` frames ``[B, T * grid^2, D]`` with an action and a state per frame
    (``[B, T, action_dim]``; and extrinsics ``[B, T, action_dim - 1]`` when the config uses them)
    -> the predicted tokens of the next frames, ``[B, T * grid^2, D]``. Per frame the sequence is
    [action, state, (extrinsics,) frame tokens]; a token attends to its own frame and the ones
    before; the conditioning tokens are rotated by their frame index only."""

    def __init__(self, encoder: EncoderConfig, config: ACPredictorConfig):
        super().__init__()
        self.config, self.grid = config, encoder.grid
        dim = config.hidden_size
        self.predictor_embed = nn.Linear(encoder.hidden_size, dim)
        self.action_encoder = nn.Linear(config.action_dim, dim)
        self.state_encoder = nn.Linear(config.action_dim, dim)
        self.extrinsics_encoder = nn.Linear(config.action_dim - 1, dim)
        self.predictor_blocks = nn.ModuleList(Block(dim, config.num_heads, config.mlp_ratio, 1e-6, fused_qkv=True)
                                              for _ in range(config.num_layers))
        self.predictor_norm = nn.LayerNorm(dim, eps=1e-6)
        self.predictor_proj = nn.Linear(dim, encoder.hidden_size)

    def forward(self, x: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                extrinsics: torch.Tensor | None = None) -> torch.Tensor:
        b, t, per_frame = len(x), actions.shape[1], self.grid * self.grid
        if x.shape[1] != t * per_frame:
            raise ValueError(f"{x.shape[1]} tokens are not {t} frames of {per_frame}")
        cond = [self.action_encoder(actions), self.state_encoder(states)]
        if self.config.use_extrinsics:
            if extrinsics is None:
                raise ValueError("this predictor needs extrinsics")
            cond.append(self.extrinsics_encoder(extrinsics))
        k = len(cond)
        frames = self.predictor_embed(x).view(b, t, per_frame, -1)
        x = torch.cat([c[:, :, None] for c in cond] + [frames], 2).flatten(1, 2)
        step = per_frame + k
        index = torch.arange(t * step, device=x.device)
        frame, slot = index // step, index % step
        spatial = slot >= k
        _, row, col = grid_positions((slot - k).clamp(min=0), self.grid)
        pos = (frame[None], row[None], col[None])
        mask = frame[:, None] >= frame[None, :]
        for block in self.predictor_blocks:
            x = block(x, pos, spatial=spatial, mask=mask)
        x = x.view(b, t, step, -1)[:, :, k:].flatten(1, 2)
        return self.predictor_proj(self.predictor_norm(x))


class VJEPA2Model(nn.Module):
    """``vjepa2``: ``encoder`` and ``predictor`` (Hugging Face's ``VJEPA2Model`` names)."""

    def __init__(self, encoder: EncoderConfig, predictor: PredictorConfig):
        super().__init__()
        self.encoder = VJEPA2Encoder(encoder)
        self.predictor = VJEPA2Predictor(encoder, predictor)


class VJEPA2ACModel(nn.Module):
    """``vjepa2_ac``: the encoder (official fused ``qkv``) and the action-conditioned predictor.

    ``encode_frames``: each frame on its own, repeated to fill a tubelet, as the 2-AC training
    and planning code does, then (``normalize``) layer-normed without affine weights."""

    def __init__(self, encoder: EncoderConfig, predictor: ACPredictorConfig):
        super().__init__()
        self.encoder = VJEPA2Encoder(encoder, fused_qkv=True)
        self.predictor = VJEPA2ACPredictor(encoder, predictor)

    def encode_frames(self, frames: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """``frames [B, T, C, H, W]`` -> ``[B, T * grid^2, D]``."""
        b, t = frames.shape[:2]
        clips = frames.flatten(0, 1)[:, None].repeat(1, self.encoder.config.tubelet_size, 1, 1, 1)
        tokens = self.encoder(clips).view(b, t * self.encoder.config.tokens_per_frame, -1)
        return F.layer_norm(tokens, tokens.shape[-1:]) if normalize else tokens

    def predict(self, tokens: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                extrinsics: torch.Tensor | None = None, normalize: bool = True) -> torch.Tensor:
        out = self.predictor(tokens, actions, states, extrinsics)
        return F.layer_norm(out, out.shape[-1:]) if normalize else out
