"""FLUX.2 diffusion transformer: double-stream blocks, then single-stream blocks.

Parameter names equal the state-dict keys of diffusers' ``Flux2Transformer2DModel``, so its
checkpoints load with ``load_state_dict(strict=True)``. All Linear layers are bias-free.

Data flow for ``N_txt`` text and ``N_img`` image tokens of width ``D = heads * head_dim``:

* ``temb`` = MLP(sinusoid(1000 t)) [+ MLP(sinusoid(1000 g))]; three shared modulation
  layers turn ``silu(temb)`` into shift / scale / gate vectors for every block of a kind.
* Double-stream block: image and text keep separate weights; LayerNorm + modulation, joint
  attention over ``[text; image]`` with per-head RMS QK-norm and rotary embedding, gated
  residual, then a gated SwiGLU MLP per stream.
* Single-stream block on ``[text; image]``: one projection yields q, k, v and the MLP input,
  one projection maps ``[attention; swiglu(mlp)]`` back (a "parallel" block).
* Output: adaptive LayerNorm on the image tokens and a linear projection.

Parallelism lives in the layers (``mstar.layers.linear``, ``mstar.layers.ulysses``): built
under a parallel state (``mstar.distributed.use_parallel``), the q/k/v and MLP input
projections are column-parallel (whole heads per tensor-parallel rank), the output
projections row-parallel, and modulation, embedders and norms replicated. With sequence
parallelism each rank keeps a shard of the text and of the image tokens (and of their
position ids) from the entry of the DiT on; attention exchanges heads for sequence around
its core (Ulysses all-to-all), and the image tokens are gathered whole at the exit. A rank's
joint sequence is ``[its text shard; its image shard]``: attention does not care about token
order, and every other step is per token. Heads must divide by ``tp_size x sp_size`` and the
MLP width by ``tp_size``; token counts need not divide (shards may be uneven, and a rank may
hold no token of one stream).
Built outside a parallel state, every layer is its plain ``torch.nn`` counterpart.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from mstar.layers.rotary import apply_rotary_pairs
from mstar.layers.ulysses import SequenceShards, UlyssesAttention
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.rope import Flux2RotaryEmbedding

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), [S, head_dim] or [B, S, head_dim]
ModParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # shift, scale, gate: [B, 1, D]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal, unmasked) softmax attention, the one place a faster kernel plugs in.

    ``q, k, v``: ``[B, S, H, head_dim]``; returns ``[B, S, H, head_dim]``.
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def norm_rope(norm: nn.RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """``apply_rotary_pairs(norm(x), cos, sin)``: per-head QK-norm, then the rotation; ``fused``:
    the two as one Triton kernel (``mstar.layers.triton_qk_norm``, the same rounding points)."""
    if fused:
        from mstar.layers.triton_qk_norm import qk_norm_rope

        return qk_norm_rope(x, norm.weight, cos, sin, norm.eps)
    return apply_rotary_pairs(norm(x), cos, sin)


def use_fused_qk_norm_rope(model: nn.Module, enabled: bool = True) -> None:
    """Switch every attention of ``model`` to (or back from) the fused QK-norm + RoPE kernel."""
    for module in model.modules():
        if isinstance(module, (JointAttention, ParallelSelfAttention)):
            module.fused_qk = enabled


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[B]`` -> float32 ``[B, dim]`` features ``[cos(t f_j), sin(t f_j)]``,
    ``f_j = max_period ** (-j / half)``."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    )
    angle = t[:, None].float() * freqs[None, :]
    emb = torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * x + shift


def split_modulation(mod: torch.Tensor, sets: int) -> list[ModParams]:
    """Raw modulation ``[B, 3 * sets * D]`` -> ``sets`` (shift, scale, gate) triples of
    ``[B, 1, D]``."""
    chunks = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return [(chunks[3 * i], chunks[3 * i + 1], chunks[3 * i + 2]) for i in range(sets)]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * value`` with ``[gate | value]`` packed in the last dimension."""
    gate, value = x.chunk(2, dim=-1)
    return F.silu(gate) * value


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class TimestepMLP(nn.Module):
    """``linear_2(silu(linear_1(x)))``."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepGuidanceEmbedding(nn.Module):
    """Conditioning vector ``temb [B, D]`` from the (scaled) timestep and guidance value."""

    def __init__(self, channels: int, dim: int, guidance_embeds: bool) -> None:
        super().__init__()
        self.channels = channels
        self.timestep_embedder = TimestepMLP(channels, dim)
        self.guidance_embedder = TimestepMLP(channels, dim) if guidance_embeds else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        temb = self.timestep_embedder(timestep_sinusoid(timestep, self.channels).to(timestep.dtype))
        if guidance is not None and self.guidance_embedder is not None:
            g = timestep_sinusoid(guidance, self.channels).to(guidance.dtype)
            temb = temb + self.guidance_embedder(g)
        return temb


class Modulation(nn.Module):
    """``linear(silu(temb))``: ``sets`` packed (shift, scale, gate) triples, shared by all
    blocks of a kind."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.sets = sets
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))


class FeedForward(nn.Module):
    """SwiGLU MLP; ``linear_in`` packs gate and value projections (a tensor-parallel rank
    holds its share of each, so ``swiglu`` pairs them on the rank)."""

    def __init__(self, dim: int, mlp_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.linear_in = MergedColumnParallelLinear(dim, [hidden, hidden], bias=False)
        self.linear_out = RowParallelLinear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(swiglu(self.linear_in(x)))


def _heads_in(dim: int, inner: int, head_dim: int) -> ColumnParallelLinear:
    """A projection to heads: column-parallel, whole heads per rank."""
    return ColumnParallelLinear(dim, inner, bias=False, block=head_dim)


def _heads_out(inner: int, dim: int, head_dim: int) -> RowParallelLinear:
    """A projection from heads back to the residual stream: row-parallel."""
    return RowParallelLinear(inner, dim, bias=False, block=head_dim)


class JointAttention(nn.Module):
    """Attention of the double-stream block: image (``to_*``) and text (``add_*``) projections.

    Inputs and outputs are this rank's tokens; ``self.attention`` sees the whole joint
    sequence (``UlyssesAttention``)."""

    fused_qk = False  # QK-norm + RoPE as one kernel (use_fused_qk_norm_rope)

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = _heads_in(dim, inner, head_dim)
        self.to_k = _heads_in(dim, inner, head_dim)
        self.to_v = _heads_in(dim, inner, head_dim)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([_heads_out(inner, dim, head_dim)])
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.add_q_proj = _heads_in(dim, inner, head_dim)
        self.add_k_proj = _heads_in(dim, inner, head_dim)
        self.add_v_proj = _heads_in(dim, inner, head_dim)
        self.to_add_out = _heads_out(inner, dim, head_dim)
        self.attention = UlyssesAttention(attention)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``img [B, N_img, D]``, ``txt [B, N_txt, D]``, rope over ``[txt; img]`` -> (img, txt)."""
        heads = (-1, self.head_dim)
        n = txt.shape[1]
        (cos_t, cos_i), (sin_t, sin_i) = (t.split([n, t.shape[-2] - n], dim=-2) for t in rope)

        def joint(norm_txt, proj_txt, norm_img, proj_img) -> torch.Tensor:
            """``[text; image]`` heads of q or k, each stream normalised by its own weights and
            rotated by its slice of the tables (rotation is per token: the same as rotating the
            joined sequence)."""
            return torch.cat([norm_rope(norm_txt, proj_txt(txt).unflatten(-1, heads), cos_t, sin_t, self.fused_qk),
                              norm_rope(norm_img, proj_img(img).unflatten(-1, heads), cos_i, sin_i, self.fused_qk)],
                             dim=1)

        q = joint(self.norm_added_q, self.add_q_proj, self.norm_q, self.to_q)
        k = joint(self.norm_added_k, self.add_k_proj, self.norm_k, self.to_k)
        v = torch.cat([self.add_v_proj(txt).unflatten(-1, heads), self.to_v(img).unflatten(-1, heads)], dim=1)
        out = self.attention(q, k, v).flatten(2).to(q.dtype)
        txt_out, img_out = out.split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


class Flux2DoubleStreamBlock(nn.Module):
    """MM-DiT block: per-stream weights, joint attention over ``[text; image]``."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.ff = FeedForward(dim, mlp_ratio)
        self.ff_context = FeedForward(dim, mlp_ratio)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        mod_img: torch.Tensor,
        mod_txt: torch.Tensor,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Image ``[B, N_img, D]``, text ``[B, N_txt, D]``, raw modulations ``[B, 6D]``
        -> (image, text)."""
        img, txt = hidden_states, encoder_hidden_states
        (i_shift, i_scale, i_gate), (i_shift2, i_scale2, i_gate2) = split_modulation(mod_img, 2)
        (t_shift, t_scale, t_gate), (t_shift2, t_scale2, t_gate2) = split_modulation(mod_txt, 2)

        img_attn, txt_attn = self.attn(
            modulate(self._norm(img), i_shift, i_scale),
            modulate(self._norm(txt), t_shift, t_scale),
            rope,
        )
        img = img + i_gate * img_attn
        img = img + i_gate2 * self.ff(modulate(self._norm(img), i_shift2, i_scale2))
        txt = txt + t_gate * txt_attn
        txt = txt + t_gate2 * self.ff_context(modulate(self._norm(txt), t_shift2, t_scale2))
        return img, _clip_fp16(txt)


class ParallelSelfAttention(nn.Module):
    """Fused projections of the single-stream block: ``to_qkv_mlp_proj`` yields
    ``[q | k | v | gate | value]``, ``to_out`` maps ``[attention | swiglu]`` back.

    Under tensor parallelism each of the five output segments is split on its own (whole
    heads for q, k, v) and ``to_out`` splits its two input segments to match, so a rank
    computes ``[its heads | its MLP features]`` and the partial outputs are summed."""

    fused_qk = False  # QK-norm + RoPE as one kernel (use_fused_qk_norm_rope)

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inner_dim = heads * head_dim
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = MergedColumnParallelLinear(
            dim, [self.inner_dim] * 3 + [self.mlp_hidden_dim] * 2, bias=False, blocks=[head_dim] * 3 + [1, 1])
        local = self.to_qkv_mlp_proj.local_sizes
        self.split_sizes = [sum(local[:3]), sum(local[3:])]  # [q | k | v], [gate | value] on this rank
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = RowParallelLinear(self.inner_dim + self.mlp_hidden_dim, dim, bias=False,
                                        input_sizes=[self.inner_dim, self.mlp_hidden_dim])
        self.attention = UlyssesAttention(attention)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        qkv, mlp = self.to_qkv_mlp_proj(x).split(self.split_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = norm_rope(self.norm_q, q, *rope, self.fused_qk), norm_rope(self.norm_k, k, *rope, self.fused_qk)
        out = self.attention(q, k, v).flatten(2).to(q.dtype)
        return self.to_out(torch.cat([out, swiglu(mlp)], dim=-1))


class Flux2SingleStreamBlock(nn.Module):
    """Parallel DiT block over the concatenated ``[text; image]`` sequence."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.attn = ParallelSelfAttention(dim, heads, head_dim, mlp_ratio, eps)

    def forward(self, hidden_states: torch.Tensor, mod: torch.Tensor, rope: Rope) -> torch.Tensor:
        """``hidden_states [B, S, D]``, raw modulation ``[B, 3D]`` -> ``[B, S, D]``."""
        ((shift, scale, gate),) = split_modulation(mod, 1)
        normed = F.layer_norm(hidden_states, hidden_states.shape[-1:], eps=self.eps)
        out = hidden_states + gate * self.attn(modulate(normed, shift, scale), rope)
        return _clip_fp16(out)


class AdaNormOut(nn.Module):
    """Final adaptive LayerNorm; ``linear(silu(temb))`` packs (scale, shift) in that order."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        normed = F.layer_norm(x, x.shape[-1:], eps=self.eps)
        return normed * (1 + scale)[:, None, :] + shift[:, None, :]


class Flux2Transformer(nn.Module):
    """The FLUX.2 denoiser: predicts the flow-matching velocity of packed latent tokens."""

    def __init__(self, config: Flux2TransformerConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        dim, heads, head_dim = c.inner_dim, c.num_attention_heads, c.attention_head_dim
        self.pos_embed = Flux2RotaryEmbedding(c.axes_dims_rope, c.rope_theta)
        self.time_guidance_embed = TimestepGuidanceEmbedding(
            c.timestep_guidance_channels, dim, c.guidance_embeds
        )
        self.double_stream_modulation_img = Modulation(dim, sets=2)
        self.double_stream_modulation_txt = Modulation(dim, sets=2)
        self.single_stream_modulation = Modulation(dim, sets=1)
        self.x_embedder = nn.Linear(c.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(c.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            Flux2DoubleStreamBlock(dim, heads, head_dim, c.mlp_ratio, c.eps)
            for _ in range(c.num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            Flux2SingleStreamBlock(dim, heads, head_dim, c.mlp_ratio, c.eps)
            for _ in range(c.num_single_layers)
        )
        self.norm_out = AdaNormOut(dim, c.eps)
        self.proj_out = nn.Linear(dim, c.patch_size**2 * c.resolved_out_channels, bias=False)
        self.sequence = SequenceShards()

    def rope(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> Rope:
        """Rotary tables for the joint ``[text; image]`` sequence.

        Ids are ``[N, n_axes]`` (shared by the batch) or ``[B, N, n_axes]`` (per sample; the
        reference model reads only sample 0, so both agree when all samples share ids).
        """
        if txt_ids.ndim != img_ids.ndim:
            if txt_ids.ndim == 2:
                txt_ids = txt_ids.expand(img_ids.shape[0], -1, -1)
            else:
                img_ids = img_ids.expand(txt_ids.shape[0], -1, -1)
        return self.pos_embed(torch.cat([txt_ids, img_ids], dim=-2))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity for latent tokens.

        Args:
            hidden_states: packed latents ``[B, N_img, in_channels]``.
            encoder_hidden_states: text features ``[B, N_txt, joint_attention_dim]``.
            timestep: ``[B]`` flow time / sigma in ``[0, 1]`` (scaled by 1000 inside).
            img_ids, txt_ids: position ids ``[N, n_axes]`` or ``[B, N, n_axes]``.
            guidance: ``[B]`` guidance scale for guidance-distilled models; ignored (as in the
                reference) when the config has no guidance embedder.

        Returns:
            ``[B, N_img, patch_size**2 * out_channels]``.

        Under sequence parallelism every rank of the SP group takes the whole inputs and
        returns the whole output; in between it holds only its shard of the tokens.
        """
        dtype = hidden_states.dtype
        timestep = timestep.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance)
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)

        shard = self.sequence.shard
        img = self.x_embedder(shard(hidden_states))
        txt = self.context_embedder(shard(encoder_hidden_states))
        rope = self.rope(shard(txt_ids, dim=-2), shard(img_ids, dim=-2))  # this rank's [text; image]

        for block in self.transformer_blocks:
            img, txt = block(img, txt, mod_img, mod_txt, rope)
        n_txt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, mod_single, rope)
        return self.sequence.gather(self.proj_out(self.norm_out(x[:, n_txt:], temb)))
