"""Tensor-parallel layers (mstar.layers.linear): at TP=2 over gloo each equals the unsharded
layer, every weight_loader takes this rank's shard of the full tensor, and outside a
parallel state each layer is its torch.nn counterpart."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed import ParallelState, use_parallel
from mstar.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mstar.layers.mlp import SwiGLU
from mstar.model.weights import WeightLoadError, load_weights
from tests.distributed.helpers import fake_tp_group, mesh, rel_error, run_ranks

TOL = 1e-6


def on_rank(rank: int, size: int) -> ParallelState:
    return ParallelState(tp=fake_tp_group(rank, size))


def randomised(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


def test_single_rank_layers_are_the_torch_layers():
    x = torch.randn(5, 12)
    pairs = [
        (lambda: nn.Linear(12, 8), lambda: ColumnParallelLinear(12, 8)),
        (lambda: nn.Linear(12, 8), lambda: RowParallelLinear(12, 8)),
        (lambda: nn.Linear(12, 8, bias=False), lambda: ParallelLMHead(12, 8)),
        (lambda: nn.Linear(12, 8), lambda: MergedColumnParallelLinear(12, [3, 5])),
    ]
    for make_ref, make_ours in pairs:
        torch.manual_seed(0)
        ref = make_ref()
        torch.manual_seed(0)
        ours = make_ours()
        assert isinstance(ours, nn.Linear)
        assert torch.equal(ours.weight, ref.weight)  # same initialisation, same RNG draws
        assert torch.equal(ours(x), ref(x)), type(ours).__name__
    torch.manual_seed(0)
    ref_emb = nn.Embedding(10, 12)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(10, 12)
    ids = torch.tensor([0, 9, 3, 3])
    assert torch.equal(emb(ids), ref_emb(ids))
    assert torch.equal(emb.logits(x), F.linear(x, ref_emb.weight))


def shards(make: Callable[[], nn.Module], size: int, full: nn.Module) -> list[nn.Module]:
    """The layer of every rank of a ``size``-way TP group, each filled by load_weights from
    ``full``'s (unsharded) state dict."""
    layers = []
    for rank in range(size):
        with use_parallel(on_rank(rank, size)):
            layer = make()
        load_weights(layer, full.state_dict().items())
        layers.append(layer)
    return layers


@pytest.mark.parametrize("size", [2, 4])
def test_weight_loaders_take_this_ranks_shard(size):
    full = randomised(nn.Linear(6, 8), 1)
    cols = shards(lambda: ColumnParallelLinear(6, 8), size, full)
    assert torch.equal(torch.cat([c.weight for c in cols]), full.weight)
    assert torch.equal(torch.cat([c.bias for c in cols]), full.bias)
    assert cols[1].weight.shape == (8 // size, 6)

    full = randomised(nn.Linear(8, 6), 2)
    rows = shards(lambda: RowParallelLinear(8, 6), size, full)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), full.weight)
    assert all(torch.equal(r.bias, full.bias) for r in rows)  # added once, after the sum

    full = randomised(nn.Linear(6, 4 + 8), 3)  # fused [a (4) | b (8)]
    merged = shards(lambda: MergedColumnParallelLinear(6, [4, 8]), size, full)
    a, b = full.weight.split([4, 8])
    for rank, m in enumerate(merged):
        ma, mb = m.weight.split(m.local_sizes)
        assert torch.equal(ma, a.chunk(size)[rank]) and torch.equal(mb, b.chunk(size)[rank])


def test_vocab_shards_are_padded_with_zeros():
    full = randomised(nn.Embedding(10, 4), 4)
    embs = shards(lambda: VocabParallelEmbedding(10, 4), 3, full)  # 4 rows per rank, 2 padded
    assert [e.weight.shape[0] for e in embs] == [4, 4, 4]
    assert torch.equal(torch.cat([e.weight for e in embs])[:10], full.weight)
    assert not embs[2].weight[2:].any()
    full = randomised(nn.Linear(4, 10, bias=False), 5)
    head = shards(lambda: ParallelLMHead(4, 10), 3, full)
    assert torch.equal(torch.cat([h.weight for h in head])[:10], full.weight)
    assert not head[2].weight[2:].any()


def test_qkv_holds_whole_heads_and_loads_segments_apart():
    head_dim, heads, kv_heads = 3, 4, 2
    q, k, v = (torch.randn(n * head_dim, 5) for n in (heads, kv_heads, kv_heads))
    for rank in range(2):
        with use_parallel(on_rank(rank, 2)):
            qkv = QKVParallelLinear(5, head_dim, heads, kv_heads, bias=False)
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        for i, part in enumerate((q, k, v)):
            qkv.load_segment(qkv.weight, i, part)
        expected = torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
        assert torch.equal(qkv.weight, expected)
        with torch.no_grad():
            qkv.weight.zero_()
        qkv.weight.weight_loader(qkv.weight, torch.cat([q, k, v]))  # one fused checkpoint tensor
        assert torch.equal(qkv.weight, expected)


def test_splits_that_would_cut_a_head_or_mismatch_are_refused():
    with use_parallel(on_rank(0, 8)), pytest.raises(ValueError, match="blocks of 8 evenly over 8"):
        ColumnParallelLinear(16, 4 * 8, block=8)  # 4 heads over 8 ranks
    with use_parallel(on_rank(0, 4)), pytest.raises(ValueError, match="segment 1"):
        QKVParallelLinear(16, 8, num_heads=4, num_kv_heads=2)
    with use_parallel(on_rank(0, 2)):
        layer = ColumnParallelLinear(6, 8)
    with pytest.raises(WeightLoadError, match="'weight'.*\\(6, 6\\).*\\(8, 6\\)"):
        load_weights(layer, [("weight", torch.zeros(6, 6)), ("bias", torch.zeros(8))])


# --------------------------------------------------------------------- TP=2 over gloo
def _forward_errors(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(7, 12)
    full_col, full_row = randomised(nn.Linear(12, 8), 1), randomised(nn.Linear(8, 12), 2)
    full_merged = randomised(nn.Linear(12, 4 + 8), 3)
    full_emb, full_head = randomised(nn.Embedding(11, 12), 4), randomised(nn.Linear(12, 11, bias=False), 5)
    full_mlp = randomised(SwiGLU(12, 16, bias=True), 6)
    ids = torch.arange(11).flip(0)

    with use_parallel(mesh(world)):
        col, gathered = ColumnParallelLinear(12, 8), ColumnParallelLinear(12, 8, gather_output=True)
        row, merged = RowParallelLinear(8, 12), MergedColumnParallelLinear(12, [4, 8])
        emb, head, mlp = VocabParallelEmbedding(11, 12), ParallelLMHead(12, 11), SwiGLU(12, 16, bias=True)
    for layer, full in ((col, full_col), (gathered, full_col), (row, full_row), (merged, full_merged),
                        (emb, full_emb), (head, full_head), (mlp, full_mlp)):
        load_weights(layer, full.state_dict().items())

    with torch.no_grad():
        ref_merged = full_merged(x).split([4, 8], dim=-1)
        return {
            "column (own slice)": rel_error(col(x), full_col(x).chunk(world, -1)[rank]),
            "column (gathered)": rel_error(gathered(x), full_col(x)),
            "row": rel_error(row(full_col(x).chunk(world, -1)[rank]), full_row(full_col(x))),
            "merged": max(rel_error(ours, ref.chunk(world, -1)[rank])
                          for ours, ref in zip(merged(x).split(merged.local_sizes, -1), ref_merged)),
            "vocab embedding": rel_error(emb(ids), full_emb(ids)),
            "tied logits": rel_error(emb.logits(x), F.linear(x, full_emb.weight)),
            "lm head": rel_error(head(x), full_head(x)),
            "swiglu (column -> row)": rel_error(mlp(x), full_mlp(x)),
        }


def test_layers_at_tp2_equal_the_unsharded_layers():
    for rank, errors in enumerate(run_ranks(_forward_errors, 2)):
        for name, err in errors.items():
            print(f"[tp=2 rank {rank}] {name}: max rel err {err:.2e}")
            assert err <= TOL, f"rank {rank} {name}: {err:.3e}"
