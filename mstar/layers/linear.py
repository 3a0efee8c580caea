"""Tensor-parallel linear layers and embeddings.

Each layer shards its weight over the TP group of the parallel state it is built under
(``mstar.distributed.use_parallel``) and keeps the group for its collectives. Outside any
parallel state the group has one rank: every layer is then exactly its ``torch.nn``
counterpart (same parameters, same initialisation, same forward), which is why they
subclass ``nn.Linear`` / ``nn.Embedding``.

Every parameter carries ``weight_loader(param, full_tensor)``, which copies this rank's
shard out of the FULL checkpoint tensor; ``mstar.model.weights.load_weights`` calls it, so
one checkpoint and one loading path serve every TP degree.

* ``ColumnParallelLinear``: output features split over ranks (optionally gathered back).
* ``RowParallelLinear``: input features split; partial products summed by all-reduce, the
  bias added once after the sum.
* ``MergedColumnParallelLinear`` / ``QKVParallelLinear``: several column-parallel outputs
  fused in one matrix (``[q | k | v]``, ``[gate | up]``); each segment is split on its own.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows split (padded to a
  multiple of the TP size); lookups all-reduce, logits all-gather.

Every layer also takes a weight-only quantised matrix (``mstar.layers.quantized``) in
``qweight``, set from outside by ``mstar.model.quantize`` after loading: its products then
replace ``F.linear`` with the float ``weight`` (an embedding keeps its float rows for the
lookups and uses ``qweight`` for tied logits only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_gather, all_reduce
from mstar.distributed.state import Group, current_parallel
from mstar.layers.quantized import QuantizedWeight

WeightLoader = Callable[[nn.Parameter, torch.Tensor], None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def _expect_shape(param: nn.Parameter, full: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(full.shape) != shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(full.shape)}, the full (unsharded) "
                         f"parameter has shape {shape} (this rank holds {tuple(param.shape)})")


def _split(size: int, tp: Group, block: int, what: str) -> int:
    """This rank's share of ``size`` features, split in whole blocks of ``block``."""
    if size % block or (size // block) % tp.size:
        raise ValueError(f"cannot split {what} of {size} features in blocks of {block} "
                         f"evenly over {tp.size} tensor-parallel ranks")
    return size // tp.size


def _shard(full: torch.Tensor, dim: int, tp: Group) -> torch.Tensor:
    return full.chunk(tp.size, dim=dim)[tp.rank]


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T + b`` with the rows of ``W`` (output features) split over TP ranks.

    Each rank returns its slice of the output features, or the whole output with
    ``gather_output``. ``block`` keeps blocks of features together (one attention head:
    ``block=head_dim``), so a rank never holds part of a head.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, block: int = 1) -> None:
        tp = current_parallel().tp
        super().__init__(in_features, _split(out_features, tp, block, "the output"), bias=bias)
        self.tp = tp
        self.full_out_features = out_features
        self.gather_output = gather_output
        self.qweight: QuantizedWeight | None = None
        set_weight_loader(self.weight, self._load_rows)
        if self.bias is not None:
            set_weight_loader(self.bias, self._load_rows)

    @torch.no_grad()
    def _load_rows(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _expect_shape(param, full, (self.full_out_features, *param.shape[1:]))
        param.copy_(_shard(full, 0, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) if self.qweight is None else self.qweight.linear(x, self.bias)
        return all_gather(y, self.tp, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class RowParallelLinear(nn.Linear):
    """``y = x W^T + b`` with the columns of ``W`` (input features) split over TP ranks.

    The input is this rank's slice of the features (the output of a column-parallel layer);
    the partial products are summed over the group and the (unsplit) bias is added once.
    ``input_sizes`` splits an input made of several segments (``[attention | mlp]``) segment
    by segment, as the merged column-parallel layer feeding it does.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, block: int = 1,
                 input_sizes: Sequence[int] | None = None) -> None:
        tp = current_parallel().tp
        sizes = list(input_sizes) if input_sizes is not None else [in_features]
        if sum(sizes) != in_features:
            raise ValueError(f"input segments {sizes} do not add up to {in_features} features")
        local = sum(_split(size, tp, block, f"input segment {i}") for i, size in enumerate(sizes))
        super().__init__(local, out_features, bias=bias)
        self.input_sizes = sizes
        self.tp = tp
        self.full_in_features = in_features
        self.qweight: QuantizedWeight | None = None
        set_weight_loader(self.weight, self._load_columns)
        if self.bias is not None:
            set_weight_loader(self.bias, self._load_whole)

    @torch.no_grad()
    def _load_columns(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _expect_shape(param, full, (self.out_features, self.full_in_features))
        segments = full.split(self.input_sizes, dim=1)
        param.copy_(torch.cat([_shard(s, 1, self.tp) for s in segments], dim=1))

    @torch.no_grad()
    def _load_whole(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _expect_shape(param, full, tuple(param.shape))
        param.copy_(full)

    def forward(self, x: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """``linear`` is the GEMM, ``F.linear`` or a kernel of its signature ``(x, weight,
        bias=None)`` (e.g. ``mstar.layers.triton_gemv.gemv`` in a small decode step); the
        all-reduce and the bias stay here, so tensor parallelism works with either. A
        quantised ``qweight`` takes the place of both."""
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias) if self.qweight is None else self.qweight.linear(x, self.bias)
        y = all_reduce(linear(x, self.weight) if self.qweight is None else self.qweight.linear(x), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several sizes fused in one matrix, each split on its own.

    The full weight stacks the segments ``[s_0 | s_1 | ...]`` (``output_sizes``); a rank holds
    ``[s_0 shard | s_1 shard | ...]``, so ``split(local_sizes)`` of the output gives its
    shard of every segment. ``blocks`` (default 1) are the per-segment block sizes.

    ``segment_names`` (optional) are the names of the unfused sibling layers a checkpoint
    stores the segments under (``("gate_proj", "up_proj")``): ``load_weights`` then fills
    segment ``i`` from ``<parent>.<segment_names[i]>.weight`` (and ``.bias``) through
    ``load_segment``, and counts the fused parameter loaded once every segment is.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = True, *,
                 blocks: Sequence[int] | None = None, segment_names: Sequence[str] | None = None) -> None:
        tp = current_parallel().tp
        blocks = list(blocks) if blocks is not None else [1] * len(output_sizes)
        local_sizes = [_split(size, tp, block, f"segment {i}")
                       for i, (size, block) in enumerate(zip(output_sizes, blocks))]
        if segment_names is not None and len(segment_names) != len(output_sizes):
            raise ValueError(f"{len(segment_names)} segment names for {len(output_sizes)} segments")
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes
        self.segment_names = tuple(segment_names) if segment_names is not None else None

    def split_output(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of every segment of an output ``y [..., sum(local_sizes)]``."""
        return y.split(self.local_sizes, dim=-1)

    @torch.no_grad()
    def _load_rows(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _expect_shape(param, full, (self.full_out_features, *param.shape[1:]))
        segments = full.split(self.output_sizes, dim=0)
        param.copy_(torch.cat([_shard(s, 0, self.tp) for s in segments], dim=0))

    @torch.no_grad()
    def load_segment(self, param: nn.Parameter, index: int, full_segment: torch.Tensor) -> None:
        """Fill segment ``index`` from its own full tensor (a checkpoint that stores
        ``q_proj``, ``k_proj``, ``v_proj`` apart)."""
        _expect_shape(param, full_segment, (self.output_sizes[index], *param.shape[1:]))
        start = sum(self.local_sizes[:index])
        param[start:start + self.local_sizes[index]].copy_(_shard(full_segment, 0, self.tp))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused ``[q | k | v]`` projection: each rank holds whole heads of each of the three."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True, *,
                 segment_names: Sequence[str] | None = None) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias=bias, blocks=[head_dim] * 3, segment_names=segment_names)
        self.head_dim = head_dim
        self.num_heads = self.local_sizes[0] // head_dim  # on this rank
        self.num_kv_heads = self.local_sizes[1] // head_dim


def _vocab_rows(vocab_size: int, tp: Group) -> tuple[int, int]:
    """``(rows per rank, first vocabulary id of this rank)``; the last shard is zero-padded."""
    per_rank = -(-vocab_size // tp.size)
    return per_rank, tp.rank * per_rank


@torch.no_grad()
def _load_vocab_rows(param: nn.Parameter, full: torch.Tensor, vocab_size: int, start: int) -> None:
    _expect_shape(param, full, (vocab_size, *param.shape[1:]))
    rows = full[start:start + param.shape[0]]
    param[: rows.shape[0]].copy_(rows)
    param[rows.shape[0]:].zero_()


def _gather_logits(local: torch.Tensor, tp: Group, vocab_size: int) -> torch.Tensor:
    logits = all_gather(local, tp, dim=-1)
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings with the vocabulary rows split over TP ranks.

    A rank looks up the ids in its range (zeros for the others) and the group sums the
    lookups. ``logits(hidden)`` uses the same rows as a tied output projection.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp = current_parallel().tp
        per_rank, self.vocab_start = _vocab_rows(num_embeddings, tp)
        super().__init__(per_rank, embedding_dim)
        self.tp = tp
        self.vocab_size = num_embeddings
        self.qweight: QuantizedWeight | None = None  # the tied logits' matrix, if quantised
        set_weight_loader(self.weight, self._load)

    @torch.no_grad()
    def _load(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _load_vocab_rows(param, full, self.vocab_size, self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(x * mine.unsqueeze(-1).to(x.dtype), self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` logits of ``hidden [N, dim]`` against these (tied) embeddings."""
        local = F.linear(hidden, self.weight) if self.qweight is None else self.qweight.linear(hidden)
        return _gather_logits(local, self.tp, self.vocab_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab={self.vocab_size}, tp={self.tp.rank}/{self.tp.size}"


class ParallelLMHead(nn.Linear):
    """Output projection ``hidden -> vocab`` (no bias) with vocabulary rows split over TP
    ranks; every rank gets the full logits."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        tp = current_parallel().tp
        per_rank, self.vocab_start = _vocab_rows(vocab_size, tp)
        super().__init__(hidden, per_rank, bias=False)
        self.tp = tp
        self.vocab_size = vocab_size
        self.qweight: QuantizedWeight | None = None
        set_weight_loader(self.weight, self._load)

    @torch.no_grad()
    def _load(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _load_vocab_rows(param, full, self.vocab_size, self.vocab_start)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight) if self.qweight is None else self.qweight.linear(hidden)
        return _gather_logits(local, self.tp, self.vocab_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab={self.vocab_size}, tp={self.tp.rank}/{self.tp.size}"
