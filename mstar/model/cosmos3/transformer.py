"""The Cosmos3 tower: a packed mixture-of-transformers with diffusers' parameter names.

Every layer holds two experts of the same shape: the understanding expert (``to_q`` ...
``to_out``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) runs the text tokens,
the generation expert (``add_q_proj`` ... ``to_add_out``, ``mlp_moe_gen``, the ``*_moe_gen``
norms) runs the media tokens (video latent patches; sound and action tokens in later modes).
Attention is one packed sequence per request, text first: text tokens attend causally to text
only, media tokens attend to every text and media token of their request.

Since text never reads media, a request's text pathway is the same at every denoise step: it
runs once (``encode_text``) and leaves, per layer, the keys and values the media tokens read
(``TextKV``); each step then runs only the media tokens (``forward``), several requests'
tokens in one pass (the projections and MLPs over the packed rows, attention per request).
The maths is diffusers' ``Cosmos3OmniTransformer.forward`` with the text half hoisted out.

Sound (``sound_gen`` towers): a request's sound latents ``[sound_dim, T]`` join its media rows
after the video patches, one token a latent frame (``audio_proj_in``, plus
``audio_modality_embed`` and the time embedding: every sound frame is noisy), and leave through
``audio_proj_out``. Actions (``action_gen`` towers): a request's action chunk follows its sound
(or its video patches), one token an action (the domain's ``action_proj_in`` and
``action_modality_embed``, the time embedding on its noisy rows), and leaves through the
domain's ``action_proj_out``. ``predict`` gives every velocity, ``forward`` the video's.

Parallelism lives in the layers, as in Wan2.2's DiT. Built under a parallel state
(``mstar.distributed.use_parallel``), both experts' q/k/v and MLP input projections are
column-parallel (whole heads per tensor-parallel rank), their output projections row-parallel
(one all-reduce after attention, one after the MLP); the q/k norms are per head, so they need no
exchange, and the embeddings, heads and final norms stay whole. With Ulysses sequence
parallelism each rank keeps a contiguous slice of a step's packed media rows (every request's
video, sound and action rows, in order) with that slice's rotary rows, from the input projections
on; around attention an all-to-all swaps "my rows, all heads" for "every row, my heads", so each
request's rows still attend to all of its media, and the rows are gathered whole before the
output heads. Slices may differ in length (``torch.tensor_split``), so nothing is padded. The
text pathway is short and runs once a request: every SP rank runs it whole (on its TP heads)
and keeps the keys and values of its own SP heads only. Heads and KV heads must divide by
``tp_size x sp_size`` and ``intermediate_size`` by ``tp_size`` (``Cosmos3.parallel_dims``,
checked at startup). Built outside a parallel state every layer is its plain ``torch.nn``
counterpart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.state import current_parallel
from mstar.layers.linear import ColumnParallelLinear, RowParallelLinear
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import to_device
from mstar.layers.rotary import MRotaryEmbedding, rotate
from mstar.layers.ulysses import SequenceShards, ulysses_attention
from mstar.model.cosmos3.config import Cosmos3Config

__all__ = ["ActionTokens", "Cosmos3Transformer", "MediaItem", "Prediction", "TextKV"]


class NemotronRMSNorm(RMSNorm):
    """Edge's RMS norm: the scale multiplies in float32, then the result is cast back."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def make_norm(config: Cosmos3Config, dim: int) -> RMSNorm:
    return (NemotronRMSNorm if config.nemotron else RMSNorm)(dim, config.rms_norm_eps)


class MLP(nn.Module):
    """Gated SiLU (``silu``) or ungated squared ReLU (``relu2``); the width split over TP ranks."""

    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gated = config.hidden_act == "silu"
        if self.gated:
            self.gate_proj = ColumnParallelLinear(d, f, bias=False)
        self.up_proj = ColumnParallelLinear(d, f, bias=False)
        self.down_proj = RowParallelLinear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(torch.relu(self.up_proj(x)).square())


@dataclass
class Segment:
    """One request's media rows in a packed step: ``length`` rows (of the whole step, whatever
    slice of it this SP rank holds), reading ``text`` (its text keys/values at this layer,
    ``[L, kv_heads, head_dim]`` each, this rank's KV heads) and, in a kv window, ``past`` (the
    committed clean keys/values of earlier windows, this rank's heads, read between the text
    and the rows); ``keep``, when a list, collects this layer's keys/values of the rows (a
    commit pass)."""

    length: int
    text: tuple[torch.Tensor, torch.Tensor]
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    keep: list | None = None


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Media attention on ``q, k, v [1, N, heads, head_dim]`` (every row of the step, this rank's
    heads): each segment's rows attend to its request's text keys/values, its committed ``past``
    and its own rows; a segment with ``keep`` collects its rows' keys/values."""
    outs, start = [], 0
    for seg in segments:
        end = start + seg.length
        rows = (k[0, start:end], v[0, start:end])
        past = () if seg.past is None else (seg.past,)
        keys = torch.cat([seg.text[0], *(p[0] for p in past), rows[0]]).transpose(0, 1)
        values = torch.cat([seg.text[1], *(p[1] for p in past), rows[1]]).transpose(0, 1)
        if seg.keep is not None:
            seg.keep.append(rows)
        # 4-D (a batch of one): the fused kernels take nothing else, and the math fallback of 3-D
        # inputs holds the whole score matrix (233 GiB for Nano's 44,160-token clip)
        out = F.scaled_dot_product_attention(q[:, start:end].transpose(1, 2), keys[None], values[None],
                                             enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
        start = end
    return torch.cat(outs)[None]


class PackedAttention(nn.Module):
    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        d, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.tp, self.sp = current_parallel().tp, current_parallel().sp
        self.heads, self.kv_heads, self.head_dim = heads // self.tp.size, kv_heads // self.tp.size, hd  # this rank's
        self.to_q = ColumnParallelLinear(d, heads * hd, bias=bias, block=hd)
        self.to_k = ColumnParallelLinear(d, kv_heads * hd, bias=bias, block=hd)
        self.to_v = ColumnParallelLinear(d, kv_heads * hd, bias=bias, block=hd)
        self.to_out = RowParallelLinear(heads * hd, d, bias=bias, block=hd)
        self.norm_q = make_norm(config, hd) if config.qk_norm_for_text else nn.Identity()
        self.norm_k = make_norm(config, hd) if config.qk_norm_for_text else nn.Identity()
        separate = config.use_und_k_norm_for_gen and not config.qk_norm_for_text
        self.k_norm_und_for_gen = make_norm(config, hd) if separate else None
        self.add_q_proj = ColumnParallelLinear(d, heads * hd, bias=bias, block=hd)
        self.add_k_proj = ColumnParallelLinear(d, kv_heads * hd, bias=bias, block=hd)
        self.add_v_proj = ColumnParallelLinear(d, kv_heads * hd, bias=bias, block=hd)
        self.to_add_out = RowParallelLinear(heads * hd, d, bias=bias, block=hd)
        self.norm_added_q = make_norm(config, hd)
        self.norm_added_k = make_norm(config, hd)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, self.head_dim))

    def text(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The text tokens ``[L, D]`` of one request: causal self-attention; also the rotated keys
        and the values the media tokens read (this SP rank's KV heads of them)."""
        cos, sin = cos[:, None], sin[:, None]
        q = self.norm_q(self._split(self.to_q(x), self.heads))
        k = self.norm_k(self._split(self.to_k(x), self.kv_heads))
        v = self._split(self.to_v(x), self.kv_heads)
        k_media = k if self.k_norm_und_for_gen is None else self.k_norm_und_for_gen(k)
        q, k, k_media = rotate(q, cos, sin), rotate(k, cos, sin), rotate(k_media, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0]
        if self.sp.size > 1:  # the media's all-to-all hands this rank every row of its heads' slice
            k_media, v = (t.chunk(self.sp.size, dim=1)[self.sp.rank].contiguous() for t in (k_media, v))
        return self.to_out(out.transpose(0, 1).flatten(-2)), (k_media, v)

    def media(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The media rows ``[N, D]`` of several requests (``segments``, in order; under SP this
        rank's slice of them, with its rotary rows): each attends to its request's text keys and
        its own media rows."""
        cos, sin = cos[:, None], sin[:, None]
        q = rotate(self.norm_added_q(self._split(self.add_q_proj(x), self.heads)), cos, sin)
        k = rotate(self.norm_added_k(self._split(self.add_k_proj(x), self.kv_heads)), cos, sin)
        v = self._split(self.add_v_proj(x), self.kv_heads)
        out = ulysses_attention(q[None], k[None], v[None], partial(attend_segments, segments=segments), self.sp)
        return self.to_add_out(out[0].flatten(-2))


class MoTLayer(nn.Module):
    """One layer: pre-norm attention and MLP, each expert with its own norms and weights."""

    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.self_attn = PackedAttention(config)
        self.mlp = MLP(config)
        self.mlp_moe_gen = MLP(config)
        self.input_layernorm = make_norm(config, d)
        self.input_layernorm_moe_gen = make_norm(config, d)
        self.post_attention_layernorm = make_norm(config, d)
        self.post_attention_layernorm_moe_gen = make_norm(config, d)

    def text(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, kv = self.self_attn.text(self.input_layernorm(x), cos, sin)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv

    def media(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        x = x + self.self_attn.media(self.input_layernorm_moe_gen(x), cos, sin, segments)
        return x + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(x))


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(x)))`` over 256 sinusoidal features (cos first) of the time."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(256, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]
        features = torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(features)))


class DomainAwareLinear(nn.Module):
    """One ``[in, out]`` weight and bias per embodiment domain (the action heads); loaded so the
    policy checkpoints are covered, run by the action modes."""

    def __init__(self, in_dim: int, out_dim: int, domains: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.fc = nn.Embedding(domains, in_dim * out_dim)
        self.bias = nn.Embedding(domains, out_dim)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        weight = self.fc(domain).view(-1, self.in_dim, self.out_dim)
        return torch.bmm(x[:, None], weight)[:, 0] + self.bias(domain)


@dataclass
class TextKV:
    """A request's text pathway, run once: per layer, the keys (rotated, normed for the media
    tokens) and values ``[L, kv_heads, head_dim]`` its media tokens read."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[0]


@dataclass
class ActionTokens:
    """A request's action chunk in a step: ``actions [T, action_dim]`` (padded to the tower's
    width), the rows ``noisy`` (the rest are clean conditions, as a video's clean frames), the
    embodiment ``domain`` selecting the action heads' weights and the rotary ``positions [3, T]``.
    They follow the video's patches in the request's packed sequence."""

    actions: torch.Tensor
    noisy: list[int]
    domain: int
    positions: torch.Tensor


@dataclass
class MediaItem:
    """One request's media in a step: ``latents [C, T, H, W]``, its ``timestep`` (the sampler's,
    0..1000), the latent frames ``noisy`` (the rest are clean conditions: no time embedding,
    zero velocity), its rotary ``positions [3, T * h * w]``, its ``text`` and, in the action
    modes, its ``action`` chunk."""

    latents: torch.Tensor
    timestep: float
    noisy: list[int]
    positions: torch.Tensor
    text: TextKV
    action: ActionTokens | None = None
    sound: torch.Tensor | None = None  # sound latents [sound_dim, T] (all noisy), after the video rows
    sound_positions: torch.Tensor | None = None  # their rotary positions [3, T]
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # kv windows: committed K/V per layer
    keep: list | None = None  # a commit pass: collects the rows' K/V per layer


@dataclass
class Prediction:
    """One item's velocities: ``video [C, T, H, W]``, for an item with sound ``sound
    [sound_dim, T]`` and for one with an action chunk ``action [T, action_dim]``."""

    video: torch.Tensor
    sound: torch.Tensor | None = None
    action: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The velocities the item has, by modality (``video``, ``sound``, ``action``)."""
        return {k: v for k, v in (("video", self.video), ("sound", self.sound), ("action", self.action))
                if v is not None}


class Cosmos3Transformer(nn.Module):
    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = make_norm(config, d)
        self.norm_moe_gen = make_norm(config, d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.proj_in = nn.Linear(config.patch_latent_dim, d)
        self.proj_out = nn.Linear(d, config.patch_latent_dim)
        self.time_embedder = TimestepEmbedding(d)
        if config.action_gen:
            self.action_proj_in = DomainAwareLinear(config.action_dim, d, config.num_embodiment_domains)
            self.action_proj_out = DomainAwareLinear(d, config.action_dim, config.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(d))
        if config.sound_gen:
            self.audio_proj_in = nn.Linear(config.sound_dim, d)
            self.audio_proj_out = nn.Linear(d, config.sound_dim)
            self.audio_modality_embed = nn.Parameter(torch.zeros(d))
        self.rope = MRotaryEmbedding(config.head_dim, config.rope_theta, list(config.rope_axes_dim))
        self.sequence = SequenceShards()

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    # ------------------------------------------------------------------ text
    def encode_text(self, ids: torch.Tensor, positions: torch.Tensor) -> TextKV:
        """Run one request's text tokens ``ids [L]`` at rotary ``positions [3, L]`` through the
        understanding expert; the keys and values its media tokens read at every layer."""
        x = self.embed_tokens(ids)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        kvs = []
        for layer in self.layers:
            x, kv = layer.text(x, cos, sin)
            kvs.append(kv)
        return TextKV(kvs)

    # ----------------------------------------------------------------- media
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """``[C, T, H, W]`` -> ``[T * h * w, p * p * C]`` tokens (frame, row, column order; each
        token's features ordered row-in-patch, column-in-patch, channel); H and W padded to ``p``."""
        p = self.config.latent_patch_size
        c, t, h, w = latents.shape
        latents = F.pad(latents, (0, -w % p, 0, -h % p))
        hp, wp = latents.shape[2] // p, latents.shape[3] // p
        x = latents.reshape(c, t, hp, p, wp, p).permute(1, 2, 4, 3, 5, 0)
        return x.reshape(t * hp * wp, p * p * c)

    def unpatchify(self, tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """The inverse of ``patchify`` for ``frames`` frames: ``[C, frames, height, width]``."""
        p, c = self.config.latent_patch_size, self.config.latent_channel
        hp, wp = -(-height // p), -(-width // p)
        x = tokens.reshape(frames, hp, wp, p, p, c).permute(5, 0, 1, 3, 2, 4)
        return x.reshape(c, frames, hp * p, wp * p)[:, :, :height, :width]

    def forward(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """One denoise step of several requests: each item's video velocity ``[C, T, H, W]``
        (``predict`` gives the sound and action velocities too)."""
        return [p.video for p in self.predict(items)]

    def forward_media(self, items: list[MediaItem]) -> list[dict[str, torch.Tensor]]:
        """``predict`` as dicts: per item ``video`` and, where it has them, ``sound`` and
        ``action``."""
        return [p.as_dict() for p in self.predict(items)]

    def _action_tokens(self, action: ActionTokens, embed: torch.Tensor) -> torch.Tensor:
        """An action chunk's input rows: the domain's projection, the modality embedding, and
        the time embedding on the noisy rows."""
        domain = torch.full((len(action.actions),), action.domain, dtype=torch.long, device=embed.device)
        x = self.action_proj_in(action.actions.to(device=embed.device, dtype=self.dtype), domain)
        x = x + self.action_modality_embed
        noisy = torch.zeros(len(x), dtype=x.dtype, device=x.device)
        noisy[list(action.noisy)] = 1
        return x + embed * noisy[:, None]

    def predict(self, items: list[MediaItem]) -> list[Prediction]:
        """One denoise step of several requests: each item's velocities (float32 maths where the
        model's dtype is; zeros on clean frames and rows). A request's rows are its video
        patches, then its sound latents, then its actions (the pipeline's packing order)."""
        p = self.config.latent_patch_size
        tokens, masks, cos, sin, shapes = [], [], [], [], []
        times = to_device(torch.tensor([float(i.timestep) for i in items]), self.proj_in.weight.device)  # no wait
        embeds = self.time_embedder(times * self.config.timestep_scale).to(self.dtype)
        for item, embed in zip(items, embeds):
            c, t, h, w = item.latents.shape
            per_frame = -(-h // p) * -(-w // p)
            x = self.proj_in(self.patchify(item.latents.to(self.dtype)))
            noisy = torch.zeros(t, dtype=torch.bool, device=x.device)
            noisy[list(item.noisy)] = True
            x = x + embed * noisy.repeat_interleave(per_frame)[:, None].to(x.dtype)
            positions = item.positions.to(x.device)
            parts, rotary = [x], [positions]
            if item.sound is not None:
                if item.sound_positions is None:
                    raise ValueError("a media item with sound needs its sound_positions")
                parts.append(self.audio_proj_in(item.sound.to(self.dtype).T) + self.audio_modality_embed + embed)
                rotary.append(item.sound_positions.to(x.device))
            if item.action is not None:
                parts.append(self._action_tokens(item.action, embed))
                rotary.append(item.action.positions.to(x.device))
            if len(parts) > 1:
                x, positions = torch.cat(parts), torch.cat(rotary, dim=1)
            tokens.append(x)
            c_, s_ = self.rope.cos_sin(positions, x.dtype)
            cos.append(c_)
            sin.append(s_)
            shapes.append((t, h, w, per_frame))
            masks.append(noisy)
        shard = partial(self.sequence.shard, dim=0)  # this SP rank's slice of the step's rows
        x, cos, sin = shard(torch.cat(tokens)), shard(torch.cat(cos)), shard(torch.cat(sin))
        for index, layer in enumerate(self.layers):
            segments = [Segment(len(tok), item.text.layers[index], None if item.past is None else item.past[index],
                                item.keep) for tok, item in zip(tokens, items)]
            x = layer.media(x, cos, sin, segments)
        x = self.norm_moe_gen(x)
        # one GEMM over every row (the few sound and action rows' results unused): a request's video
        # velocity then has the same bits packed or alone (per-request GEMMs on offset slices did not)
        patches = self.sequence.gather(self.proj_out(x), dim=0)
        if any(item.sound is not None or item.action is not None for item in items):
            x = self.sequence.gather(x, dim=0)  # the sound and action heads read their rows' hidden states
        out, start = [], 0
        for (t, h, w, per_frame), noisy, item, tok in zip(shapes, masks, items, tokens):
            v = self.unpatchify(patches[start:start + t * per_frame], t, h, w)
            rest = start + t * per_frame  # the first row after the video's
            sound = action = None
            if item.sound is not None:
                length = item.sound.shape[1]
                sound = self.audio_proj_out(x[rest:rest + length]).T
                rest += length
            if item.action is not None:
                action = self._action_velocity(item.action, x[rest:start + len(tok)])
            start += len(tok)
            out.append(Prediction(v * noisy[None, :, None, None].to(v.dtype), sound, action))
        return out

    def _action_velocity(self, action: ActionTokens, rows: torch.Tensor) -> torch.Tensor:
        velocity = torch.zeros(len(rows), self.config.action_dim, dtype=rows.dtype, device=rows.device)
        noisy = list(action.noisy)
        if noisy:
            domain = torch.full((len(noisy),), action.domain, dtype=torch.long, device=rows.device)
            velocity[noisy] = self.action_proj_out(rows[noisy], domain)
        return velocity
