"""GLM-5.2's attention: multi-head latent attention (MLA) over a paged latent cache, with the
DSA indexer choosing the keys each query attends to.

MLA. A token's keys and values are not cached per head: ``kv_a_proj_with_mqa`` compresses it
into a latent ``c`` (``kv_lora_rank`` wide, RMS-normed) and one rotary key ``k_rot``
(``qk_rope_head_dim``, shared by the heads); ``kv_b_proj`` would expand ``c`` into each head's
non-rotary key and value. Here the expansion is absorbed into the query and the output
instead (``W_uk``, ``W_uv``: the two halves of each head's rows of ``kv_b_proj``): the scores are
``(q_nope W_uk) . c + q_rot . k_rot`` and the output ``W_uv (softmax . c)``, so attention reads the
cached rows as they are, whatever the number of heads. In float32 it equals the expanded form
to rounding (the parity test's 1e-5).

DSA. The indexer (``Glm52Indexer``) has its own small projections: queries from the attention's
compressed query ``q_resid`` (``index_n_heads`` heads of ``index_head_dim``), one key per token
from the hidden state (LayerNorm-ed, its first ``qk_rope_head_dim`` channels rotated). A query's
score for a key is ``sum_h w_h relu(q_h . k / sqrt(d))``, with per-token head weights
``weights_proj(x) / sqrt(index_n_heads)``; the query attends only to its ``index_topk`` best
keys among those it may see (all of them while there are fewer). A ``"shared"`` layer has no
indexer and reuses the choice of the layer before it.

The paged cache holds one row per token and layer, ``[c | k_rot | k_index]``
(``Glm52Config.cache_width``; a ``planes=1`` cache of ``mstar.layers.paged_kv``), so the indexer's
keys live with the latents and go wherever the pages go (a shared layer leaves its index
part unused).

Rotary embeddings are DeepSeek's interleaved pairs ``(x0, x1), (x2, x3), ...``; the rotated
channels come out de-interleaved (the rotated evens, then the rotated odds), the same for
queries and keys, so their dot products are unchanged.

Tensor parallelism: the heads are split (``q_b_proj``, ``kv_b_proj`` by head, ``o_proj`` by its
input, which all-reduces); the compressions, the cache and the indexer are whole on every
rank, so every rank picks the same keys.

The attention here is the torch reference: one sequence at a time, the chosen keys as a mask
over all its keys. A fused sparse kernel (FlashMLA-style, reading only the chosen rows) is the
GPU fast path still to come; it would take ``Glm52Indexer.select``'s choice as indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import ColumnParallelLinear, RowParallelLinear
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.glm52.config import Glm52Config

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (not rms_norm_eps)
INDEX_QUERY_CHUNK = 256  # queries scored at once by the indexer: bounds its [n, heads, keys] scores


def rope_tables(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, dim / 2]`` in float32: one angle per interleaved pair."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs of ``x [T, H, R]`` by the tables ``[T, R / 2]``; the result is
    the rotated even channels, then the rotated odd ones."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def sequence_slots(meta: PagedAttentionMetadata, b: int, length: int, device: torch.device) -> torch.Tensor:
    """The cache slots of sequence ``b``'s first ``length`` positions."""
    size = meta.page_size
    pages = meta.page_table[b, :-(-length // size)].to(device)
    return (pages[:, None] * size + torch.arange(size, device=device)).reshape(-1)[:length]


class Glm52Indexer(nn.Module):
    """The DSA indexer of one layer (key names: ``self_attn.indexer.*``)."""

    def __init__(self, config: Glm52Config) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # float32 whatever the model's dtype (``Glm52ForCausalLM.to_dtype``): made so at once
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=torch.float32)

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = rotate_interleaved(x[..., :self.rope_dim], cos, sin)
        return torch.cat((rot, x[..., self.rope_dim:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The cached keys ``[T, head_dim]`` of the step's tokens (``x``: the normed hidden states)."""
        return self._rotated(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[T, heads, head_dim]`` and head weights ``[T, heads]`` (float32)."""
        q = self._rotated(self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q.float(), weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Which keys each query attends to, ``[n, L]`` (True: attend): its ``topk`` best scores
        among the keys ``visible [n, L]`` to it (all of them while there are fewer). ``keys``
        are ``[L, D]``, shared by the queries (a sequence's), or ``[n, L, D]``, one row's each
        (a decode group's, padded: the padding not visible)."""
        keys = keys.float()
        scale = self.head_dim ** -0.5
        chosen = torch.zeros_like(visible)
        k = min(self.topk, keys.shape[-2])
        shared = keys.dim() == 2
        for s in range(0, q.shape[0], INDEX_QUERY_CHUNK):
            e = s + INDEX_QUERY_CHUNK
            dots = torch.einsum("nhd,ld->nhl", q[s:e], keys) if shared else \
                torch.einsum("nhd,nld->nhl", q[s:e], keys[s:e])
            scores = torch.einsum("nh,nhl->nl", weights[s:e], F.relu(dots * scale))
            scores = scores.masked_fill(~visible[s:e], float("-inf"))
            chosen[s:e].scatter_(1, scores.topk(k, dim=-1).indices, True)
        return chosen & visible


class Glm52Attention(nn.Module):
    """Multi-head latent attention with DSA (key names: ``self_attn.*``)."""

    def __init__(self, config: Glm52Config, layer: int) -> None:
        super().__init__()
        self.config = config
        self.rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
        heads = config.num_attention_heads
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * config.qk_head_dim, bias=False,
                                             block=config.qk_head_dim)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope_dim + self.v_dim), bias=False,
                                              block=self.nope_dim + self.v_dim)
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, bias=bias, block=self.v_dim)
        self.num_heads = self.q_b_proj.out_features // config.qk_head_dim  # this rank's
        self.scale = config.qk_head_dim ** -0.5
        self.indexer = Glm52Indexer(config) if config.indexer_types[layer] == "full" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedAttentionMetadata,
                kv_cache: torch.Tensor, chosen: dict | None) -> tuple[torch.Tensor, dict]:
        """``x [T, hidden]`` (normed) -> ``([T, hidden], chosen)``: the keys each query attended
        to (made here by the indexer; a shared layer takes the previous layer's), per decode
        group ``i`` (``meta.decode_groups``: ``[rows, padded length]``) and per prefilling
        sequence ``("seq", b)`` (``[new tokens, length]``)."""
        heads, rank = self.num_heads, self.rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(-1, heads, self.config.qk_head_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = rotate_interleaved(q_rot, cos, sin)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([rank, self.rope_dim], dim=-1)
        row = [self.kv_a_layernorm(latent), rotate_interleaved(k_rot[:, None, :], cos, sin)[:, 0]]
        index_q = None
        if self.indexer is not None:
            row.append(self.indexer.keys(x, cos, sin))
            index_q = self.indexer.queries(x, q_resid, cos, sin)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        width = sum(r.shape[-1] for r in row)
        flat[:, :width].index_copy_(0, meta.slot_mapping.to(x.device), torch.cat(row, dim=-1).to(flat.dtype))

        w_kv = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, rank)
        w_uk, w_uv = w_kv[:, :self.nope_dim], w_kv[:, self.nope_dim:]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out = x.new_empty(x.shape[0], heads, rank)
        made: dict[object, torch.Tensor] = {}
        groups, single = meta.decode_groups
        for i, group in enumerate(groups):  # one new token each: batched, keys padded to the group's length
            index = group.index.to(x.device)
            rows = flat.index_select(0, group.slots.to(x.device)).view(len(group.rows), group.length, -1)
            visible = ~group.padding.to(x.device)
            made[i] = self._choose(index_q, index, rows, visible, chosen, i)
            out.index_copy_(0, index, self._attend(q_latent[index], q_rot[index], rows.to(x.dtype), made[i]))
        starts = meta.query_starts
        for b, length in enumerate(meta.seq_lens_list):  # prefills: each sequence's queries over its keys
            s, e = starts[b], starts[b + 1]
            if e == s or b in single:
                continue
            rows = flat.index_select(0, sequence_slots(meta, b, length, x.device))
            visible = torch.arange(length, device=x.device)[None, :] <= meta.positions[s:e].to(x.device)[:, None]
            made[("seq", b)] = self._choose(index_q, slice(s, e), rows, visible, chosen, ("seq", b))
            out[s:e] = self._attend(q_latent[s:e], q_rot[s:e], rows.to(x.dtype), made[("seq", b)])
        values = torch.einsum("thr,hvr->thv", out, w_uv)
        return self.o_proj(values.reshape(x.shape[0], heads * self.v_dim)), made

    def _choose(self, index_q: tuple[torch.Tensor, torch.Tensor] | None, rows: torch.Tensor | slice,
                cached: torch.Tensor, visible: torch.Tensor, chosen: dict | None, key: object) -> torch.Tensor:
        """The keys the queries ``rows`` of the step attend to: the indexer's choice over the
        cached rows' index keys, or a shared layer's inherited ``chosen[key]``."""
        if index_q is None:
            return chosen[key]
        q, weights = index_q
        return self.indexer.select(q[rows], weights[rows], cached[..., self.rank + self.rope_dim:], visible)

    def _attend(self, q_latent: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        """``softmax(scores) . c`` ``[n, heads, rank]`` for queries ``[n, heads, .]`` over cached
        rows ``[L, width]`` (shared by the queries) or ``[n, L, width]`` (one row's each), only
        the ``chosen [n, L]`` keys."""
        c, k_rot = cached[..., :self.rank], cached[..., self.rank:self.rank + self.rope_dim]
        if cached.dim() == 2:
            scores = torch.einsum("nhr,lr->nhl", q_latent, c) + torch.einsum("nhd,ld->nhl", q_rot, k_rot)
        else:
            scores = torch.einsum("nhr,nlr->nhl", q_latent, c) + torch.einsum("nhd,nld->nhl", q_rot, k_rot)
        probs = (scores * self.scale).float().masked_fill(~chosen[:, None], float("-inf")).softmax(-1).to(c.dtype)
        return torch.einsum("nhl,lr->nhr", probs, c) if cached.dim() == 2 else torch.einsum("nhl,nlr->nhr", probs, c)
