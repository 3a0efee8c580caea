"""The Wan video DiT (Wan2.2-TI2V-5B): video tokens from a 3D patch embedding attend to
themselves with 3D rotary positions, then to the prompt, under adaLN modulation by the time.

Parameter names equal the state dict keys of diffusers' ``WanTransformer3DModel`` (0.42.1), so a
checkpoint's ``transformer/`` folder loads by name. The numerics follow it too: layer norms and
the modulation arithmetic run in float32 whatever the weights' dtype, the rotary tables are
computed in float64.

TI2V's per-token time (diffusers' ``expand_timesteps``): ``t`` may be ``[B, N]``, one time per
video token, so the clean first frame of an image-to-video request sits at time 0 while the
rest is noised. Each distinct time value is embedded once and gathered per token.

Parallelism lives in the layers, as in FLUX.2's DiT: built under a parallel state
(``mstar.distributed.use_parallel``), q/k/v and the FFN's input projection are column-parallel
(whole heads per tensor-parallel rank), the output projections row-parallel, and the time and
text embedders replicated. Wan normalises q and k over the whole width (every head at once), so
under TP the RMS norm sums its squares over the ranks before it scales (``WideRMSNorm``). With
Ulysses sequence parallelism each rank keeps a contiguous shard of the video tokens (with its
rows of the rotary tables and, for TI2V, of the per-token times) from the patch embedding on;
self-attention exchanges heads for sequence around its core, cross-attention needs no exchange
(every rank holds the whole prompt and attends its own queries to it), and the tokens are gathered
whole before unpatchifying. Shards may be uneven (``torch.tensor_split``), so no token count
needs padding; heads must divide by ``tp_size x sp_size`` and ``ffn_dim`` by ``tp_size``
(``Wan22.parallel_dims``, checked at startup). Built outside a parallel state, every layer is
its plain ``torch.nn`` counterpart.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import ColumnParallelLinear, RowParallelLinear
from mstar.layers.mlp import TextProjection, linear_gelu_tanh
from mstar.layers.norm import WideRMSNorm
from mstar.layers.ulysses import SequenceShards, UlyssesAttention, full_attention
from mstar.model.flux2.transformer import timestep_sinusoid
from mstar.model.wan22.config import WanTransformerConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [N, head_dim / 2]
KeysValues = tuple[torch.Tensor, torch.Tensor]  # an attention's k, v
PromptKeys = list[KeysValues]  # every block's cross-attention key and value projections of a prompt


def layer_norm32(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm`` applied in float32 (diffusers' ``FP32LayerNorm``), result in float32."""
    weight = None if norm.weight is None else norm.weight.float()
    bias = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps)


def rope_tables(dim: int, length: int, theta: float = 10000.0) -> Rope:
    """(cos, sin) ``[length, dim / 2]`` of positions ``0..length-1``, computed in float64."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate the interleaved pairs ``(x[2i], x[2i+1])`` of ``x [B, N, H, D]`` by ``rope``, in
    the tables' dtype (bf16 in a bf16 deployment, as diffusers' Wan rounds; the shared
    ``layers.rotary.apply_rotary_pairs`` works in float32 and drifts ~4e-3 from it there)."""
    cos, sin = (r[None, :, None, :] for r in rope)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class WanRope(nn.Module):
    """The 3D rotary table: each head's channels split (frame, row, column); a token at grid
    cell ``(f, r, c)`` turns each slice by its own coordinate."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        self.dims = config.rope_dims
        tables = [rope_tables(d, config.rope_max_seq_len) for d in self.dims]
        # in the model's dtype (built in bf16: the bf16 tables apply_rope rounds with, as a cast gave)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", torch.cat([c for c, _ in tables], dim=1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([s for _, s in tables], dim=1).to(dtype), persistent=False)
        self.max_len = config.rope_max_seq_len

    def forward(self, grid: tuple[int, int, int], first_frame: int = 0) -> Rope:
        """The tables of a ``grid`` of tokens whose frames start at position ``first_frame`` (a
        causal rollout's chunk sits at its absolute frame, LingBot-World)."""
        f, h, w = grid
        if max(first_frame + f, h, w) > self.max_len:
            raise ValueError(f"token grid {grid} at frame {first_frame} exceeds the DiT's {self.max_len} "
                             "rotary positions")
        halves = [d // 2 for d in self.dims]

        def table(full: torch.Tensor) -> torch.Tensor:
            tf, th, tw = full.split(halves, dim=1)
            tf = tf[first_frame:first_frame + f]
            return torch.cat([tf[:, None, None].expand(f, h, w, -1), th[None, :h, None].expand(f, h, w, -1),
                              tw[None, None, :w].expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1)

        return table(self.cos), table(self.sin)


class WanAttention(nn.Module):
    """Self- (``context`` None) or cross-attention with RMS-normed queries and keys across all
    heads (diffusers' ``rms_norm_across_heads``). Self-attention sees the whole video sequence
    under SP (``UlyssesAttention``); cross-attention attends this rank's tokens to the prompt."""

    def __init__(self, dim: int, heads: int, eps: float, cross: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.to_q = ColumnParallelLinear(dim, dim, block=self.head_dim)
        self.to_k = ColumnParallelLinear(dim, dim, block=self.head_dim)
        self.to_v = ColumnParallelLinear(dim, dim, block=self.head_dim)
        self.to_out = nn.ModuleList([RowParallelLinear(dim, dim, block=self.head_dim)])
        self.norm_q = WideRMSNorm(dim, eps, self.head_dim)
        self.norm_k = WideRMSNorm(dim, eps, self.head_dim)
        self.attention = full_attention if cross else UlyssesAttention(full_attention)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_q(self.to_q(x)).unflatten(2, (-1, self.head_dim))

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> KeysValues:
        """``k, v [B, L, H, D]`` of the key and value projections ``[B, L, D]``, the keys
        normed (not yet rotated)."""
        heads = (-1, self.head_dim)
        return self.norm_k(k).unflatten(2, heads), v.unflatten(2, heads)

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v [B, S, H, D]``: normed queries and keys, rotated by ``rope`` when given."""
        q = self.query(x)
        kv = x if context is None else context
        k, v = self.keys_values(self.to_k(kv), self.to_v(kv))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, rope: Rope | None = None,
                projected: KeysValues | None = None) -> torch.Tensor:
        """Self-attention, or cross-attention to ``context``, or to its keys and values
        ``projected`` already (``to_k(context), to_v(context)``: a prompt's are the same at
        every step)."""
        if projected is None:
            q, k, v = self.project(x, context, rope)
        else:
            q, (k, v) = self.query(x), self.keys_values(*projected)
        out = self.attention(q, k, v)
        return self.to_out[0](out.flatten(2).type_as(q))


class GeluProjection(nn.Module):
    """``proj`` then tanh-approximated GELU (diffusers' ``GELU`` activation module). With
    ``fused_kernels`` (set by ``use_fused_kernels``) on CUDA, the bias and the GELU are the
    product's epilogue (``mstar.layers.mlp.linear_gelu_tanh``)."""

    fused_kernels: bool = False

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels and self.proj.qweight is None and not self.proj.gather_output:  # two passes off CUDA
            return linear_gelu_tanh(x, self.proj.weight, self.proj.bias)
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))`` (diffusers' ``FeedForward`` key layout)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, hidden), nn.Dropout(0.0), RowParallelLinear(hidden, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class WanBlock(nn.Module):
    """Modulated self-attention, cross-attention to the prompt, modulated feed-forward."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, config.num_attention_heads, eps)
        self.attn2 = WanAttention(dim, config.num_attention_heads, eps, cross=True)
        self.norm2 = nn.LayerNorm(dim, eps) if config.cross_attn_norm else None
        self.ffn = FeedForward(dim, config.ffn_dim)
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, prompt: KeysValues, time: torch.Tensor, rope: Rope) -> torch.Tensor:
        """``x [B, N, D]``, ``prompt``: the cross-attention's key and value projections of
        the prompt, ``time [B, 1 or N, 6, D]`` (float32)."""
        mods = (self.scale_shift_table + time.float()).unbind(2)
        shift, scale, gate, c_shift, c_scale, c_gate = mods
        h = (layer_norm32(x, self.norm1) * (1 + scale) + shift).type_as(x)
        x = (x.float() + self.attn1(h, rope=rope) * gate).type_as(x)
        h = x if self.norm2 is None else layer_norm32(x, self.norm2).type_as(x)
        x = x + self.attn2(h, projected=prompt)
        h = (layer_norm32(x, self.norm3) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


class TimeEmbedding(nn.Module):
    """``linear_2(silu(linear_1(x)))`` (diffusers' ``TimestepEmbedding``)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class ConditionEmbedder(nn.Module):
    """The time's embedding (and its six modulation vectors per block) and the prompt's projection."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        self.freq_dim = config.freq_dim
        self.time_embedder = TimeEmbedding(config.freq_dim, config.dim)
        self.time_proj = nn.Linear(config.dim, 6 * config.dim)
        self.text_embedder = TextProjection(config.text_dim, config.dim)

    def time(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``t [B, T]`` (time x 1000) -> ``temb [B, T, D]`` and ``time_proj [B, T, 6, D]``.

        A row's times take at most two values (TI2V: the step's time, and 0 on an image's
        condition frame), so each row's smallest and largest are embedded and every token takes
        one of the two: no data-dependent shapes (``torch.unique``), so the host never waits for
        the GPU here. A row with a third value fails an assertion on the device."""
        low, high = t.amin(dim=1, keepdim=True), t.amax(dim=1, keepdim=True)
        torch._assert_async(((t == low) | (t == high)).all(), "a row's per-token times take more than two values")
        values = torch.cat([low, high], dim=1).flatten()  # [2B]: row b's low at 2b, high at 2b + 1
        features = timestep_sinusoid(values, self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(features).to(dtype)
        proj = self.time_proj(F.silu(temb))
        rows = torch.arange(t.shape[0], device=t.device)[:, None]
        where = 2 * rows + (t == high).long()
        return temb[where], proj[where].unflatten(-1, (6, -1))


def use_fused_kernels(dit: nn.Module, enabled: bool = True) -> None:
    """Turn the DiT's fused paths on or off: each feed-forward's GELU as its first product's
    epilogue (CUDA only; the CPU keeps the two-pass path)."""
    for module in dit.modules():
        if isinstance(module, GeluProjection):
            module.fused_kernels = enabled


class WanTransformer(nn.Module):
    """The DiT with diffusers ``WanTransformer3DModel`` parameter names."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim, patch = config.dim, config.patch_size
        self.rope = WanRope(config)
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.condition_embedder = ConditionEmbedder(config)
        self.blocks = nn.ModuleList(WanBlock(config) for _ in range(config.num_layers))
        self.norm_out = nn.LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(patch))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.sequence = SequenceShards()

    def prompt_keys(self, text: torch.Tensor) -> PromptKeys:
        """Every block's cross-attention key and value projections of ``text [B, L, text_dim]``
        (the pipeline's zero-padded prompt features), ``[B, L, D]`` each. They are the same at
        every denoise step of a request: a loop computes them once and passes them to each
        ``forward``. The keys' RMS norm is left to the step: under TP it sums over the ranks,
        and this must be no collective (each rank decides for itself when to recompute)."""
        context = self.condition_embedder.text_embedder(text)
        return [(block.attn2.to_k(context), block.attn2.to_v(context)) for block in self.blocks]

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None = None,
                prompt: PromptKeys | None = None) -> torch.Tensor:
        """One DiT evaluation. ``latents [B, C, F, H, W]``; ``t``: the time x 1000 (1000 = noise),
        ``[B]`` or per token ``[B, N]``; ``text [B, L, text_dim]`` (the pipeline's zero-padded
        prompt features), or ``prompt``, their ``prompt_keys``. Returns the flow prediction
        ``[B, out_channels, F, H, W]``.

        Under sequence parallelism every rank of the SP group takes the whole inputs and
        returns the whole output; in between it holds only its shard of the video tokens."""
        b, _, frames, height, width = latents.shape
        pt, ph, pw = self.config.patch_size
        grid = (frames // pt, height // ph, width // pw)
        shard = self.sequence.shard
        rope = tuple(shard(table, dim=0) for table in self.rope(grid))  # this rank's positions
        x = shard(self.patch_embedding(latents).flatten(2).transpose(1, 2)).contiguous()
        t = t[:, None] if t.ndim == 1 else t
        if t.shape[1] > 1:  # per-token times (TI2V): this rank's tokens
            t = shard(t)
        if prompt is None:
            prompt = self.prompt_keys(text)
        temb, time = self.condition_embedder.time(t, prompt[0][1].dtype)
        for block, keys in zip(self.blocks, prompt, strict=True):
            x = block(x, keys, time, rope)
        shift, scale = (self.scale_shift_table[:, None] + temb[:, :, None]).unbind(2)
        x = (layer_norm32(x, self.norm_out) * (1 + scale) + shift).type_as(x)
        x = self.sequence.gather(self.proj_out(x)).reshape(b, *grid, pt, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, frames, height, width)
