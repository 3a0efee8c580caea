"""The LTX-2.x joint audio-video DiT: a video token stream and an audio token stream run side by
side through every block. Each block gives each stream self-attention (rotary positions in
seconds and pixels), cross-attention to its prompt features, then the two streams attend to
each other (audio-to-video: video queries over audio; video-to-audio: the reverse) on a shared
time axis, then a feed-forward; all under adaLN modulation by the time.

Parameter names equal the state dict keys of diffusers' ``LTX2VideoTransformer3DModel``
(0.42.1), so a checkpoint's ``transformer/`` folder loads by name; the maths follows it too
(rotary tables and their products in float32, frequencies in float64).

The time enters in four places: the streams' own modulation (``time_embed``,
``audio_time_embed``), the audio-video attentions' scale/shift and gate
(``av_cross_attn_*``), the prompt features' modulation where the variant has one
(``prompt_adaln``; LTX-2.5 replaces it with a fixed per-block table so the prompt's keys and
values do not change across steps), and the output layer.

Parallelism lives in the layers, as in the Wan DiT: built under a parallel state
(``mstar.distributed.use_parallel``), every attention's q/k/v (and its per-head gate logits)
are column-parallel by whole heads, the output projections and the FFNs' second linear
row-parallel; the q/k norms act over all heads, so under TP they all-reduce their squares
(``WideRMSNorm``), and each rank turns its heads by its slice of the rotary tables. With
Ulysses SP each rank keeps a contiguous shard of the video tokens (their rotary rows and any
per-token modulation with them); video self-attention exchanges heads for sequence around its
core. The audio stream is short (a few hundred tokens against tens of thousands of video ones),
so every rank holds all of it and runs its self-attention locally. Audio-to-video attention
needs nothing exchanged (this rank's video queries over all audio keys); for video-to-audio
attention each rank gathers the whole modulated video stream for its keys and values, so every
rank computes the same audio update. Heads must divide by TP (and video heads by TP x SP),
checked at startup by ``Ltx25.parallel_dims``; shards may be uneven.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.state import Group, current_parallel
from mstar.layers.linear import ColumnParallelLinear, RowParallelLinear
from mstar.layers.mlp import TextProjection
from mstar.layers.norm import WideRMSNorm
from mstar.layers.ulysses import SequenceShards, UlyssesAttention, full_attention
from mstar.model.flux2.transformer import timestep_sinusoid
from mstar.model.ltx2_5.config import LtxTransformerConfig
from mstar.model.ltx2_5.rope import LtxRope, Rope, apply_rope, audio_coords, video_coords

TIME_FEATURES = 256  # sinusoidal timestep features (PixArt-alpha's embedder)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight, the mean square taken in float32."""
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x * scale).to(x.dtype)


def modulation(table: torch.Tensor, time: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's learnt ``table [n, D]`` plus the time's ``[B, T, n * D]`` -> n vectors ``[B, T, D]``."""
    return (table + time.unflatten(-1, (table.shape[0], -1))).unbind(2)


def rope_heads(rope: Rope, tp: Group) -> Rope:
    """This TP rank's slice of a rotary table built for every head (its heads are a contiguous
    slice of the width: the last axis of an interleaved table, the group axis of a split one)."""
    if tp.size == 1:
        return rope
    dim = -1 if rope[0].ndim == 3 else 2
    return tuple(t.chunk(tp.size, dim=dim)[tp.rank] for t in rope)


class LtxAttention(nn.Module):
    """Attention with RMS-normed queries and keys across all heads, separate query and key
    rotary tables (the audio-video attentions turn each side by its own clock), and optional
    per-head gates ``2 sigmoid(to_gate_logits(x))`` on the output. ``sequence`` (video
    self-attention) runs the core through Ulysses under SP; the others attend this rank's
    queries to the keys they are given."""

    def __init__(self, dim: int, context_dim: int, heads: int, head_dim: int, *, bias: bool, out_bias: bool,
                 gated: bool, eps: float = 1e-6, sequence: bool = False) -> None:
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.tp = current_parallel().tp
        self.norm_q = WideRMSNorm(inner, eps, head_dim)
        self.norm_k = WideRMSNorm(inner, eps, head_dim)
        self.to_q = ColumnParallelLinear(dim, inner, bias=bias, block=head_dim)
        self.to_k = ColumnParallelLinear(context_dim, inner, bias=bias, block=head_dim)
        self.to_v = ColumnParallelLinear(context_dim, inner, bias=bias, block=head_dim)
        self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, bias=out_bias, block=head_dim)])
        self.to_gate_logits = ColumnParallelLinear(dim, heads) if gated else None
        self.ulysses = UlyssesAttention(full_attention) if sequence else None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                q_rope: Rope | None = None, k_rope: Rope | None = None) -> torch.Tensor:
        """``x [B, N, dim]``; ``context [B, L, context_dim]`` (None: self-attention); ``mask``
        an additive bias broadcastable to ``[B, heads, N, L]``."""
        kv = x if context is None else context
        q, k, v = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(kv)), self.to_v(kv)
        if q_rope is not None:
            k_rope = q_rope if k_rope is None else k_rope
            q, k = apply_rope(q, rope_heads(q_rope, self.tp)), apply_rope(k, rope_heads(k_rope, self.tp))
        q, k, v = (t.unflatten(2, (-1, self.head_dim)) for t in (q, k, v))
        if self.ulysses is not None:
            out = self.ulysses(q, k, v).type_as(x)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).type_as(x)
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]
        return self.to_out[0](out.flatten(2))


class GeluProjection(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))``, four times wide (diffusers' ``FeedForward`` keys)."""

    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, 4 * dim, bias), nn.Dropout(0.0),
                                  RowParallelLinear(4 * dim, dim, bias=bias)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class StepTimes(NamedTuple):
    """The time's contributions a block reads, each ``[B, 1 or N, n * D]``."""

    video: torch.Tensor  # 6 (or 9 with query modulation) vectors of the video stream
    audio: torch.Tensor
    video_av: torch.Tensor  # 4: scale/shift of the video side of a2v and v2a
    audio_av: torch.Tensor
    video_av_gate: torch.Tensor  # 1: the a2v output gate
    audio_av_gate: torch.Tensor  # 1: the v2a output gate
    video_prompt: torch.Tensor | None  # 2: shift/scale of the prompt features (None: the fixed table)
    audio_prompt: torch.Tensor | None


class StepRopes(NamedTuple):
    video: Rope  # this rank's video tokens under SP
    audio: Rope
    video_time: Rope  # 1-D tables of the audio-video attentions (video: this rank's tokens)
    audio_time: Rope
    video_time_keys: Rope  # every video token's: the keys of video-to-audio attention


class LtxBlock(nn.Module):
    """One joint block; parameter names follow diffusers' ``LTX2VideoTransformerBlock``."""

    def __init__(self, c: LtxTransformerConfig) -> None:
        super().__init__()
        dim, adim, eps = c.dim, c.audio_dim, c.norm_eps
        self.eps = eps
        common = dict(bias=c.attention_bias, out_bias=c.attention_out_bias)
        vh, vd, ah, ad = c.num_attention_heads, c.attention_head_dim, c.audio_num_attention_heads, \
            c.audio_attention_head_dim
        self.attn1 = LtxAttention(dim, dim, vh, vd, gated=c.gated_attn, sequence=True, **common)
        self.audio_attn1 = LtxAttention(adim, adim, ah, ad, gated=c.audio_gated_attn, **common)
        self.attn2 = LtxAttention(dim, c.cross_attention_dim, vh, vd, gated=c.gated_attn, **common)
        self.audio_attn2 = LtxAttention(adim, c.audio_cross_attention_dim, ah, ad, gated=c.audio_gated_attn,
                                        **common)
        self.audio_to_video_attn = LtxAttention(dim, adim, ah, ad, gated=c.gated_attn, **common)
        self.video_to_audio_attn = LtxAttention(adim, dim, ah, ad, gated=c.audio_gated_attn, **common)
        self.ff = FeedForward(dim, c.ff_bias)
        self.audio_ff = FeedForward(adim, c.audio_ff_bias)
        self.video_query_mod = c.cross_attn_mod
        self.audio_query_mod = c.audio_cross_attn_mod
        self.scale_shift_table = nn.Parameter(torch.randn(9 if c.cross_attn_mod else 6, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(
            torch.randn(9 if c.audio_cross_attn_mod else 6, adim) / adim**0.5)
        if c.prompt_modulation:
            self.prompt_scale_shift_table = nn.Parameter(torch.randn(2, dim))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.randn(2, adim))
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, adim))
        self.sequence = SequenceShards()

    def forward(self, x: torch.Tensor, a: torch.Tensor, text: torch.Tensor, audio_text: torch.Tensor,
                times: StepTimes, ropes: StepRopes, text_bias: torch.Tensor | None,
                audio_text_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, N, D]`` video and ``a [B, M, Da]`` audio tokens; ``text``/``audio_text`` the
        projected prompt features; the biases additive masks over the prompt."""
        eps = self.eps
        vm = modulation(self.scale_shift_table, times.video)
        am = modulation(self.audio_scale_shift_table, times.audio)

        # self-attention
        x = x + self.attn1(rms_norm(x, eps) * (1 + vm[1]) + vm[0], q_rope=ropes.video) * vm[2]
        a = a + self.audio_attn1(rms_norm(a, eps) * (1 + am[1]) + am[0], q_rope=ropes.audio) * am[2]

        # cross-attention to the prompt
        if hasattr(self, "prompt_scale_shift_table"):
            text = self._modulate_prompt(text, self.prompt_scale_shift_table, times.video_prompt)
            audio_text = self._modulate_prompt(audio_text, self.audio_prompt_scale_shift_table, times.audio_prompt)
        h = rms_norm(x, eps)
        if self.video_query_mod:
            h = h * (1 + vm[7]) + vm[6]
        out = self.attn2(h, text, mask=text_bias)
        x = x + (out * vm[8] if self.video_query_mod else out)
        h = rms_norm(a, eps)
        if self.audio_query_mod:
            h = h * (1 + am[7]) + am[6]
        out = self.audio_attn2(h, audio_text, mask=audio_text_bias)
        a = a + (out * am[8] if self.audio_query_mod else out)

        # the streams attend to each other (scale before shift in these tables)
        v_scale_a2v, v_shift_a2v, v_scale_v2a, v_shift_v2a = modulation(
            self.video_a2v_cross_attn_scale_shift_table[:4], times.video_av)
        a_scale_a2v, a_shift_a2v, a_scale_v2a, a_shift_v2a = modulation(
            self.audio_a2v_cross_attn_scale_shift_table[:4], times.audio_av)
        (a2v_gate,) = modulation(self.video_a2v_cross_attn_scale_shift_table[4:], times.video_av_gate)
        (v2a_gate,) = modulation(self.audio_a2v_cross_attn_scale_shift_table[4:], times.audio_av_gate)
        hx, ha = rms_norm(x, eps), rms_norm(a, eps)
        x = x + a2v_gate * self.audio_to_video_attn(
            hx * (1 + v_scale_a2v) + v_shift_a2v, ha * (1 + a_scale_a2v) + a_shift_a2v,
            q_rope=ropes.video_time, k_rope=ropes.audio_time)
        a = a + v2a_gate * self.video_to_audio_attn(
            ha * (1 + a_scale_v2a) + a_shift_v2a, self.sequence.gather(hx * (1 + v_scale_v2a) + v_shift_v2a),
            q_rope=ropes.audio_time, k_rope=ropes.video_time_keys)

        # feed-forward
        x = x + self.ff(rms_norm(x, eps) * (1 + vm[4]) + vm[3]) * vm[5]
        a = a + self.audio_ff(rms_norm(a, eps) * (1 + am[4]) + am[3]) * am[5]
        return x, a

    @staticmethod
    def _modulate_prompt(text: torch.Tensor, table: torch.Tensor, time: torch.Tensor | None) -> torch.Tensor:
        shift, scale = modulation(table, time) if time is not None else table.to(text.dtype).unbind(0)
        return text * (1 + scale) + shift


class TimeEmbedder(nn.Module):
    """``linear_2(silu(linear_1(sinusoid(t))))`` (diffusers' ``TimestepEmbedding`` keys)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIME_FEATURES, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        features = timestep_sinusoid(t, TIME_FEATURES).to(dtype)
        return self.linear_2(F.silu(self.linear_1(features)))


class TimeEmbedding(nn.Module):
    """A time's embedding ``emb`` and ``n`` modulation vectors ``linear(silu(emb))`` (diffusers'
    ``LTX2AdaLayerNormSingle``; the ``emb.timestep_embedder`` key path kept)."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.emb = nn.Module()
        self.emb.timestep_embedder = TimeEmbedder(dim)
        self.linear = nn.Linear(dim, n * dim)

    def forward(self, t: torch.Tensor, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``t [B]`` or ``[B, T]`` -> (``[B, T, n * D]``, ``[B, T, D]``)."""
        emb = self.emb.timestep_embedder(t.flatten(), dtype)
        return self.linear(F.silu(emb)).view(batch, -1, self.linear.out_features), emb.view(batch, -1, emb.shape[-1])


def prompt_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A ``[B, L]`` keep-mask (1 = attend) as the additive bias ``[B, 1, 1, L]`` (-10000 off)."""
    if mask is None:
        return None
    return ((1 - mask.to(dtype)) * -10000.0)[:, None, None, :]


class LtxTransformer(nn.Module):
    """The DiT with diffusers ``LTX2VideoTransformer3DModel`` parameter names."""

    def __init__(self, config: LtxTransformerConfig) -> None:
        super().__init__()
        self.config = c = config
        dim, adim = c.dim, c.audio_dim
        self.proj_in = nn.Linear(c.in_channels, dim)
        self.audio_proj_in = nn.Linear(c.audio_in_channels, adim)
        if c.use_keyframes_abs_pos_embedding:
            self.keyframes_abs_pos_embedding = nn.Parameter(torch.zeros(1, dim))
        if c.use_prompt_embeddings:
            self.caption_projection = TextProjection(c.caption_channels, dim)
            self.audio_caption_projection = TextProjection(c.caption_channels, adim)
        self.time_embed = TimeEmbedding(dim, 9 if c.cross_attn_mod else 6)
        self.audio_time_embed = TimeEmbedding(adim, 9 if c.audio_cross_attn_mod else 6)
        self.av_cross_attn_video_scale_shift = TimeEmbedding(dim, 4)
        self.av_cross_attn_audio_scale_shift = TimeEmbedding(adim, 4)
        self.av_cross_attn_video_a2v_gate = TimeEmbedding(dim, 1)
        self.av_cross_attn_audio_v2a_gate = TimeEmbedding(adim, 1)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(2, adim) / adim**0.5)
        if c.prompt_modulation and c.use_prompt_adaln_single:
            self.prompt_adaln = TimeEmbedding(dim, 2)
            self.audio_prompt_adaln = TimeEmbedding(adim, 2)
        self.transformer_blocks = nn.ModuleList(LtxBlock(c) for _ in range(c.num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, c.out_channels)
        self.audio_norm_out = nn.LayerNorm(adim, eps=1e-6, elementwise_affine=False)
        self.audio_proj_out = nn.Linear(adim, c.audio_out_channels)

        time_extent = max(c.pos_embed_max_pos, c.audio_pos_embed_max_pos)
        rope = dict(theta=c.rope_theta, layout=c.rope_type, double_precision=c.rope_double_precision)
        self.video_rope = LtxRope(dim, (c.pos_embed_max_pos, c.base_height, c.base_width),
                                  groups=c.num_attention_heads, **rope)
        self.audio_rope = LtxRope(adim, (c.audio_pos_embed_max_pos,), groups=c.audio_num_attention_heads, **rope)
        # the audio-video attentions: time only, audio's width; the video side's split layout
        # groups by the video head count (as diffusers builds it)
        self.video_time_rope = LtxRope(adim, (time_extent,), groups=c.num_attention_heads, **rope)
        self.audio_time_rope = LtxRope(adim, (time_extent,), groups=c.audio_num_attention_heads, **rope)
        self.sequence = SequenceShards()

    def video_coords(self, grid: tuple[int, int, int], fps: float, device: torch.device | None = None) -> torch.Tensor:
        """``[1, 3, N, 2]`` box bounds of a latent video grid ``(frames, rows, columns)``."""
        c = self.config
        return video_coords(grid, c.vae_scale_factors, (c.patch_size_t, c.patch_size, c.patch_size),
                            c.causal_offset, fps, device)

    def audio_coords(self, frames: int, device: torch.device | None = None) -> torch.Tensor:
        """``[1, 1, M, 2]`` time bounds of ``frames`` audio latent frames."""
        c = self.config
        return audio_coords(frames, c.audio_scale_factor, c.audio_patch_size_t, c.causal_offset,
                            c.audio_hop_length, c.audio_sampling_rate, device)

    def step_times(self, t: torch.Tensor, audio_t: torch.Tensor, sigma: torch.Tensor, audio_sigma: torch.Tensor,
                   batch: int, dtype: torch.dtype, cross_timestep: bool) -> tuple[StepTimes, torch.Tensor,
                                                                                  torch.Tensor]:
        """Every time-derived tensor of one step, and the two output-layer embeddings."""
        c = self.config
        video, video_emb = self.time_embed(t, batch, dtype)
        audio, audio_emb = self.audio_time_embed(audio_t, batch, dtype)
        video_prompt = audio_prompt = None
        if hasattr(self, "prompt_adaln"):
            video_prompt = self.prompt_adaln(sigma, batch, dtype)[0]
            audio_prompt = self.audio_prompt_adaln(audio_sigma, batch, dtype)[0]
        video_av_t = audio_sigma.flatten() if cross_timestep else t.flatten()
        audio_av_t = sigma.flatten() if cross_timestep else audio_t.flatten()
        gate_scale = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        times = StepTimes(
            video=video, audio=audio,
            video_av=self.av_cross_attn_video_scale_shift(video_av_t, batch, dtype)[0],
            audio_av=self.av_cross_attn_audio_scale_shift(audio_av_t, batch, dtype)[0],
            video_av_gate=self.av_cross_attn_video_a2v_gate(video_av_t * gate_scale, batch, dtype)[0],
            audio_av_gate=self.av_cross_attn_audio_v2a_gate(audio_av_t * gate_scale, batch, dtype)[0],
            video_prompt=video_prompt, audio_prompt=audio_prompt)
        return times, video_emb, audio_emb

    def forward(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, audio_text: torch.Tensor,
                t: torch.Tensor, *, grid: tuple[int, int, int] | None = None, fps: float = 24.0,
                video_coords: torch.Tensor | None = None, audio_coords: torch.Tensor | None = None,
                text_mask: torch.Tensor | None = None, audio_text_mask: torch.Tensor | None = None,
                audio_t: torch.Tensor | None = None, sigma: torch.Tensor | None = None,
                audio_sigma: torch.Tensor | None = None, cross_timestep: bool = True,
                keyframes_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT evaluation on packed tokens. ``video [B, N, in_channels]`` (the latent grid
        ``grid`` flattened frame-major) and ``audio [B, M, audio_in_channels]``; ``text`` and
        ``audio_text [B, L, caption_channels or width]`` the connectors' prompt features with
        ``text_mask [B, L]`` (1 = a real token; ``audio_text_mask`` defaults to it); ``t`` the
        time x 1000, ``[B]`` or per token ``[B, N]``; ``audio_t`` defaults to ``t``, ``sigma``
        (the prompt modulation's and, with ``cross_timestep``, the other stream's time) to
        ``t``, ``audio_sigma`` to ``sigma``. Positions come from ``grid`` and ``fps`` (or
        ``video_coords``) and the audio length (or ``audio_coords``). Returns the velocity
        predictions ``[B, N, out_channels]`` and ``[B, M, audio_out_channels]``."""
        b = video.shape[0]
        audio_t = t if audio_t is None else audio_t
        sigma = t if sigma is None else sigma
        audio_sigma = sigma if audio_sigma is None else audio_sigma
        if video_coords is None:
            if grid is None:
                raise ValueError("give the latent grid (frames, rows, columns) or video_coords")
            video_coords = self.video_coords(grid, fps, video.device)
        if audio_coords is None:
            audio_coords = self.audio_coords(audio.shape[1], audio.device)
        shard = self.sequence.shard
        video_time = self.video_time_rope(video_coords[:, :1])
        ropes = StepRopes(tuple(shard(r) for r in self.video_rope(video_coords)), self.audio_rope(audio_coords),
                          tuple(shard(r) for r in video_time), self.audio_time_rope(audio_coords[:, :1]), video_time)
        text_bias = prompt_bias(text_mask, video.dtype)
        audio_text_bias = prompt_bias(text_mask if audio_text_mask is None else audio_text_mask, audio.dtype)

        x, a = self.proj_in(video), self.audio_proj_in(audio)
        if keyframes_mask is not None and hasattr(self, "keyframes_abs_pos_embedding"):
            x = x + (keyframes_mask > 0).to(x.dtype) * self.keyframes_abs_pos_embedding.to(x.dtype)
        x = shard(x)  # this rank's video tokens from here to the output layer
        times, video_emb, audio_emb = self.step_times(t, audio_t, sigma, audio_sigma, b, x.dtype, cross_timestep)
        times, video_emb = self._shard_video_times(times, video_emb, video.shape[1])
        if self.config.use_prompt_embeddings:
            text, audio_text = self.caption_projection(text), self.audio_caption_projection(audio_text)
        for block in self.transformer_blocks:
            x, a = block(x, a, text, audio_text, times, ropes, text_bias, audio_text_bias)

        shift, scale = (self.scale_shift_table + video_emb[:, :, None]).unbind(2)
        x = self.sequence.gather(self.proj_out(self.norm_out(x) * (1 + scale) + shift))
        shift, scale = (self.audio_scale_shift_table + audio_emb[:, :, None]).unbind(2)
        a = self.audio_proj_out(self.audio_norm_out(a) * (1 + scale) + shift)
        return x, a

    def _shard_video_times(self, times: StepTimes, video_emb: torch.Tensor,
                           tokens: int) -> tuple[StepTimes, torch.Tensor]:
        """Per-token video modulation (``[B, N, ...]``) cut to this rank's tokens; per-row
        (``[B, 1, ...]``) tensors and the audio stream's stay whole."""
        if self.sequence.sp.size == 1:
            return times, video_emb

        def shard(x: torch.Tensor) -> torch.Tensor:
            return self.sequence.shard(x) if x.shape[1] == tokens > 1 else x

        times = times._replace(video=shard(times.video), video_av=shard(times.video_av),
                               video_av_gate=shard(times.video_av_gate))
        return times, shard(video_emb)
