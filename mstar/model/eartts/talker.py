"""The EarTTS talker (NeMo's ``RVQEARTTSModel``, inference side): one frame of 31 RVQ codes
per text token.

A frame's input is the previous frame's codes (summed codebook vectors, projected) fused
with the text token's embedding by a learned gate (``GatedProjectedSumRMSNorm``); a Gemma-3
text backbone (head dim 72, RoPE with a local and a global base, sandwich RMSNorms, sliding
window on five layers of six) runs it over the paged KV cache; then a mixture-of-Gaussians
head unmasks the frame's codes depth-first over ``num_iter`` iterations (MaskGIT-style):
each iteration samples a mixture component (top-p, Gumbel-max), draws a latent from it,
and greedily quantizes the next ``k`` depths of the residual against the codec's codebooks.

Classifier-free guidance runs every session as two streams, the conditional one and the
unconditional one whose text embedding is the learned ``null_emb``; the guided hidden state
is ``cond + g * (cond - uncond)`` inside the MoG head. Sampling noise comes in as tensors
(``FrameNoise``) so the engine can draw it per session from the session's own generator.

The text embedding of a token is taken from a table (``TextTable``): the released model
computes it with a character-aware encoder (a T5-Gemma encoder over the token's characters,
plus continuation and BOS/EOS flags), a function of the token id alone, run once at load
time (``text_encoder.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.eartts.config import TalkerConfig


class GemmaNorm(nn.Module):
    """RMSNorm with a ``1 + weight`` gain, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, D]`` at ``positions [T]`` (angles in fp32)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device).float() / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: TalkerConfig, layer: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.window = config.window(layer)
        self.theta = config.theta(layer)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = GemmaNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor,
                longest: int | None = None) -> torch.Tensor:
        """``longest``: the most positions any sequence of the cache can reach; a window at
        least that wide never binds and is left out (exact; the Triton kernels have none)."""
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(tokens, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        q, k = _rope(q, meta.positions, self.theta), _rope(k, meta.positions, self.theta)
        width = kv_cache.shape[-1]
        if width > self.head_dim:  # a pool padded to a kernel's head dim (FlashInfer: 64/128/256)
            pad = (0, width - self.head_dim)  # zero lanes add nothing to q.k nor to the output
            q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
        window = None if longest is not None and self.window is not None and self.window >= longest else self.window
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, window=window)[..., : self.head_dim]
        return self.o_proj(out.reshape(tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: TalkerConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = GatedMLP(hidden, config.intermediate_size)
        self.input_layernorm = GemmaNorm(hidden, eps)
        self.post_attention_layernorm = GemmaNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaNorm(hidden, eps)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor,
                longest: int | None = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta, kv_cache, longest))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                longest: int | None = None) -> torch.Tensor:
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, meta, cache, longest)
        return self.norm(x)


class GatedFusion(nn.Module):
    """``norm(sigmoid(r) * (sigmoid(g) * A(code / 31) + (1 - sigmoid(g)) * B(text)))``.

    The divisor is 31 whatever the codebook count: the reference passes ``num_quantizers`` to
    the constructor's ``final_norm`` place, leaving ``num_codebooks`` at its default (31, the
    released codec's count, so the released model is unaffected)."""

    num_codebooks = 31

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.audio_proj = nn.Linear(hidden, hidden)
        self.text_proj = nn.Linear(hidden, hidden)
        self.gate = nn.Parameter(torch.zeros(hidden))
        self.residual_scale = nn.Parameter(torch.tensor(0.5))
        self.final_norm = GemmaNorm(hidden)

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        audio_h = self.audio_proj(audio / self.num_codebooks)
        text_h = self.text_proj(text)
        gate = torch.sigmoid(self.gate.float()).to(audio_h.dtype)
        scale = torch.sigmoid(self.residual_scale.float()).to(audio_h.dtype)
        return self.final_norm(scale * (gate * audio_h + (1 - gate) * text_h))


class MLPLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = GemmaNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate)
        self.post_norm = GemmaNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


class MoGHead(nn.Module):
    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        hidden, n = config.hidden_size, config.mog_num_predictions
        self.num_predictions, self.out_size = n, config.latent_size
        self.low_rank = config.mog_low_rank
        self.min_log_std = config.mog_min_log_std
        self.mlp_stack = nn.Sequential(
            *[MLPLayer(hidden, config.mog_intermediate_size, config.mog_eps) for _ in range(config.mog_num_layers)],
            GemmaNorm(hidden, config.mog_eps))
        rank = self.low_rank or self.out_size
        self.proj_logits = nn.Linear(hidden, n, bias=False)
        self.proj_mus = nn.Linear(hidden, n * rank, bias=False)
        self.proj_logs = nn.Linear(hidden, 1, bias=False)
        if self.low_rank is not None:
            self.proj_else = nn.Linear(hidden, self.out_size, bias=False)
            self.low_mat = nn.Parameter(torch.zeros(n, self.out_size, self.low_rank))

    def sample(self, x: torch.Tensor, uncond: torch.Tensor | None, guidance: float, top_p: float | int,
               gumbel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen component's mean ``[B, latent]`` and the log std ``[B, 1]`` for inputs
        ``x [B, H]`` (``uncond``: the unconditional stream's, for guidance)."""
        x = self.mlp_stack(x)
        if uncond is not None:
            u = self.mlp_stack(uncond)
            x = x + guidance * (x - u)
        logits = _filter(self.proj_logits(x), top_p)
        choice = (F.log_softmax(logits.float(), dim=-1) + gumbel.float()).argmax(-1)  # [B]
        rank = self.low_rank or self.out_size
        mus = self.proj_mus.weight.view(self.num_predictions, rank, -1)[choice]  # [B, rank, H]
        mu = torch.bmm(mus, x.unsqueeze(2)).squeeze(2)
        if self.low_rank is not None:
            mu = torch.bmm(self.low_mat[choice], mu.unsqueeze(2)).squeeze(2)
            residual = self.proj_else(x)
        else:
            residual = torch.zeros_like(mu)
        logs = self.proj_logs(x).clamp_min(self.min_log_std)
        return mu * torch.exp(logs.float()).to(logs.dtype) + residual, logs


def _filter(logits: torch.Tensor, top_p: float | int) -> torch.Tensor:
    """Top-p (a float: the smallest set whose probability passes ``top_p``, ties at the
    boundary kept, as transformers' ``TopPLogitsWarper``) or top-k (an int) filtering."""
    if isinstance(top_p, int) and not isinstance(top_p, bool):
        k = min(top_p, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    if top_p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[..., -1:] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def unmask_schedule(num_quantizers: int, num_iter: int, exponent: float) -> list[int]:
    """Depths unmasked at each of ``num_iter`` iterations (zeros are skipped iterations):
    the reference's cosine-like schedule ``(1 - r^e)^(1/e)`` over ``r = i / num_iter``."""
    rates = torch.linspace(0.0, 1.0, num_iter + 1, dtype=torch.float32)[:-1].unsqueeze(-1)  # in any build
    masking = (1 - rates.pow(exponent)).pow(1 / exponent)
    counts = torch.ceil(masking * num_quantizers).long()
    ks = counts - F.pad(counts[1:], [0, 0, 0, 1])
    return [int(k) for k in ks[:, 0]]


@functools.cache
def _active_iterations(num_quantizers: int, num_iter: int, exponent: float) -> int:
    """The schedule's iterations that unmask something (worked out once, not per session and frame)."""
    return sum(1 for k in unmask_schedule(num_quantizers, num_iter, exponent) if k)


def noise_shape(config: TalkerConfig) -> tuple[int, int, int]:
    """A frame's noise per session: (active iterations, mixture components, latent size)."""
    active = _active_iterations(config.num_quantizers, config.num_iter, config.exponent)
    return active, config.mog_num_predictions, config.latent_size


def gumbel(uniform: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gumbel noise from uniform draws (elementwise: the same per element however batched)."""
    return -torch.log(-torch.log(uniform + eps) + eps)


@dataclass
class FrameNoise:
    """One frame's sampling noise for ``B`` sessions: per active unmasking iteration, Gumbel
    noise over the mixture components ``[I, B, n]`` and a standard normal latent ``[I, B, D]``."""

    gumbel: torch.Tensor
    gauss: torch.Tensor

    @staticmethod
    def draw(config: TalkerConfig, generator: torch.Generator, device: torch.device | str = "cpu") -> FrameNoise:
        """One session's noise ``[I, 1, ...]`` from its own generator."""
        active, components, latent = noise_shape(config)
        u = torch.rand(active, 1, components, generator=generator, device=device)
        gauss = torch.randn(active, 1, latent, generator=generator, device=device)
        return FrameNoise(gumbel(u), gauss)

    @staticmethod
    def stack(noises: list[FrameNoise]) -> FrameNoise:
        return FrameNoise(torch.cat([n.gumbel for n in noises], 1), torch.cat([n.gauss for n in noises], 1))


class TextTable(nn.Module):
    """Per-token text embeddings: ``on[id]`` for a token the talker speaks, ``off[id]`` for a
    masked one (the warm-up's prompt positions: only the continuation and BOS/EOS flags)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        # Not in the checkpoint (which holds the character-aware encoder): set by the loader.
        self.register_buffer("on", torch.zeros(vocab, hidden), persistent=False)
        self.register_buffer("off", torch.zeros(vocab, hidden), persistent=False)

    def replace(self, on: torch.Tensor, off: torch.Tensor) -> None:
        device, dtype = self.on.device, self.on.dtype
        self.on, self.off = on.to(device, dtype), off.to(device, dtype)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` None: every token spoken (a step's tokens: ``on[ids]``, with no read of a mask)."""
        if mask is None:
            return self.on[ids]
        if not bool(mask.any()):  # the reference skips the text encoder when nothing is unmasked
            return torch.zeros(*ids.shape, self.on.shape[1], dtype=self.on.dtype, device=ids.device)
        return torch.where(mask[..., None], self.on[ids], self.off[ids])


class EarTTSTalker(nn.Module):
    """The talker's components under the checkpoint's names (``backbone``, ``embed_code``,
    ``gated_fusion_audio_text``, ``mog_head``, ``bos_emb``, ``null_emb``, ``rvq_embs``)."""

    def __init__(self, config: TalkerConfig, text_vocab: int = 1) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.backbone = Backbone(config)
        self.bos_emb = nn.Parameter(torch.zeros(hidden))
        self.null_emb = nn.Parameter(torch.zeros(hidden))
        self.embed_code = nn.Linear(config.latent_size, hidden, bias=False)
        if not config.use_gated_fusion:
            raise ValueError("tts_config.use_gated_fusion_for_text_audio: only the gated fusion is ported")
        self.gated_fusion_audio_text = GatedFusion(hidden)
        self.mog_head = MoGHead(config)
        self.register_buffer("rvq_embs", torch.zeros(config.num_quantizers, config.codebook_size, config.latent_size))
        if config.use_audio_prompt_projection:
            self.register_buffer("audio_prompt_projection_W", torch.zeros(hidden, hidden))
        self.text = TextTable(text_vocab, hidden)
        self.schedule = unmask_schedule(config.num_quantizers, config.num_iter, config.exponent)

    # -- inputs ----------------------------------------------------------------------------
    def code_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """``embed_code`` of the summed codebook vectors of ``codes [..., Q]`` (index
        ``codebook_size``, the pad/mask code, adds nothing)."""
        table = F.pad(self.rvq_embs, [0, 0, 0, 1])
        summed = F.embedding(codes[..., 0], table[0])
        for i in range(1, codes.shape[-1]):
            summed = summed + F.embedding(codes[..., i], table[i])
        return self.embed_code(summed)

    def warmup_code_embeds(self, codes: torch.Tensor, audio_mask: torch.Tensor,
                           prompt_latent: torch.Tensor | None = None) -> torch.Tensor:
        """One session's warm-up audio inputs ``[T, H]``: its codes shifted right by one, the
        speaker prompt (positions before the first audio position) replaced by
        ``prompt_latent`` (or the frozen projection of their code embeddings), and ``bos_emb``
        added at the first audio position."""
        shifted = F.pad(codes[:-1], [0, 0, 1, 0])
        embeds = self.code_embeds(shifted)
        bos = audio_mask & ~F.pad(audio_mask[:-1], [1, 0])
        before = (bos.long().cumsum(0) == 0)[:, None]
        if self.config.use_audio_prompt_projection:
            if prompt_latent is None:
                prompt_latent = F.linear(embeds, self.audio_prompt_projection_W.T)
            embeds = torch.where(before, prompt_latent, embeds)
        return embeds + bos[:, None] * self.bos_emb

    def fuse(self, audio: torch.Tensor, text: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """Backbone inputs from audio ``[T, H]`` and text ``[T, H]`` embeddings; rows with
        ``uncond`` take ``null_emb`` for their text."""
        text = torch.where(uncond[:, None], self.null_emb.to(text.dtype), text)
        return self.gated_fusion_audio_text(audio, text)

    def hidden(self, embeds: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               longest: int | None = None) -> torch.Tensor:
        """The backbone's last hidden states; ``longest``: as ``Attention.forward``'s."""
        return self.backbone(embeds, meta, kv_caches, longest)

    # -- sampling --------------------------------------------------------------------------
    def sample_codes(self, cond: torch.Tensor, uncond: torch.Tensor | None, noise: FrameNoise, *,
                     guidance: float, top_p: float | int, noise_scale: float) -> torch.Tensor:
        """One frame's codes ``[B, Q]`` from the conditional (and unconditional) hidden states
        ``[B, H]`` (``uncond`` None or ``guidance`` 0: no guidance)."""
        batch, depth = cond.shape[0], self.config.num_quantizers
        codes = torch.full((batch, depth), self.config.codebook_size, dtype=torch.long, device=cond.device)
        if guidance <= 0:
            uncond = None
        start, step = 0, 0
        for k in self.schedule:
            if k == 0:
                continue
            masked = self.code_embeds(codes)
            mean, logs = self.mog_head.sample(masked + cond, None if uncond is None else masked + uncond,
                                              guidance, top_p, noise.gumbel[step])
            z = mean + torch.exp(logs) * noise.gauss[step].to(mean.dtype) * noise_scale
            codes = self._quantize(z, codes, start, k)
            start, step = start + k, step + 1
        return codes

    def _quantize(self, residual: torch.Tensor, codes: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Greedy residual quantization of depths ``start .. start + count`` (the nearest
        codebook vector at each depth, subtracted before the next)."""
        codes = codes.clone()
        for i in range(start, start + count):
            table = self.rvq_embs[i]
            distance = table.pow(2).sum(-1) - 2 * (residual.unsqueeze(-2) @ table.T).squeeze(-2)
            index = distance.argmin(-1)
            residual = residual - F.embedding(index, table)
            codes[:, i] = index
        return codes

