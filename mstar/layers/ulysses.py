"""Ulysses sequence parallelism for full (non-causal) attention, as DiTs use it.

Each rank of the SP group holds a shard of the token sequence, with every head of its TP
shard. Around attention, one all-to-all turns ``[B, S/sp, H, D]`` into ``[B, S, H/sp, D]``
(the whole sequence, a slice of the heads), attention runs unchanged on that, and a second
all-to-all turns the result back into ``[B, S/sp, H, D]``. Everything outside attention
(projections, norms, MLPs, RoPE on each token's own position) is per token and runs on the
shard as is.

In a TP x SP mesh the heads are split by TP first (column-parallel projections), and the
all-to-all runs within the SP group, over the ``H / tp`` heads of this TP rank. Shards may
have different lengths (``torch.tensor_split`` of an odd sequence); the sequence is
reassembled in rank order, which full attention does not care about.

A model marks its sequence-parallel region with ``SequenceShards``: ``shard`` at the entry
(tokens and their position ids), ``gather`` at the exit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_gather, all_to_all, sizes_of_ranks
from mstar.distributed.state import Group, current_parallel

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q, k, v)`` of ``[B, S, H, D]`` -> ``[B, S, H, D]``."""

SEQ_DIM, HEAD_DIM = 1, 2


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention on ``[B, S, H, D]`` (the default inner attention)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: AttentionFn,
                      group: Group) -> torch.Tensor:
    """``attention`` over the whole sequence, for ``q, k, v [B, S_local, H, D]`` holding this
    rank's sequence shard; returns this shard's output ``[B, S_local, H, D]``."""
    if group.size == 1:
        return attention(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[HEAD_DIM] % group.size:
            raise ValueError(f"{name} has {t.shape[HEAD_DIM]} heads, not divisible by sp_size {group.size}")
    lens = sizes_of_ranks(q.shape[SEQ_DIM], group)
    if q.shape == k.shape == v.shape:  # one exchange for all three
        qkv = all_to_all(torch.stack((q, k, v)), group, scatter_dim=HEAD_DIM + 1, gather_dim=SEQ_DIM + 1,
                         gather_sizes=lens)
        q, k, v = qkv.unbind(0)
    else:
        q, k, v = (all_to_all(t, group, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM, gather_sizes=lens)
                   for t in (q, k, v))
    out = attention(q, k, v)  # [B, S, H / sp, D]
    return all_to_all(out, group, scatter_dim=SEQ_DIM, gather_dim=HEAD_DIM, scatter_sizes=lens)


class UlyssesAttention(nn.Module):
    """Full attention over a sequence split across the SP group it is built under.

    A drop-in for the attention call of a DiT block: ``forward(q, k, v)`` on this rank's
    tokens, ``[B, S_local, H_local, D]`` in and out. With one SP rank it is ``attention``.
    """

    def __init__(self, attention: AttentionFn = full_attention) -> None:
        super().__init__()
        self.sp = current_parallel().sp
        self.attention = attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, self.attention, self.sp)

    def extra_repr(self) -> str:
        return f"sp={self.sp.rank}/{self.sp.size}"


def shard_sequence(x: torch.Tensor, group: Group, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``dim`` (``torch.tensor_split``: the
    first ``S % sp`` ranks hold one token more)."""
    if group.size == 1:
        return x
    return torch.tensor_split(x, group.size, dim=dim)[group.rank]


def gather_sequence(x: torch.Tensor, group: Group, dim: int = SEQ_DIM) -> torch.Tensor:
    """Every rank's shard of the sequence concatenated along ``dim`` in rank order (the
    inverse of ``shard_sequence``; shards may differ in length)."""
    if group.size == 1:
        return x
    lens = sizes_of_ranks(x.shape[dim], group)
    longest = max(lens)
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, longest - x.shape[dim]]
    gathered = all_gather(F.pad(x, pad), group, dim=dim)
    parts = gathered.split([longest] * group.size, dim=dim)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim)


class SequenceShards(nn.Module):
    """The entry and exit of a model's sequence-parallel region, over the SP group it is
    built under: ``shard`` keeps this rank's tokens of a whole sequence (hidden states and
    their position ids alike), ``gather`` puts the whole sequence back together on every
    rank. With one SP rank both return their input."""

    def __init__(self) -> None:
        super().__init__()
        self.sp = current_parallel().sp

    def shard(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        return shard_sequence(x, self.sp, dim)

    def gather(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        return gather_sequence(x, self.sp, dim)

    def extra_repr(self) -> str:
        return f"sp={self.sp.rank}/{self.sp.size}"
