"""Fused projections (``[q | k | v]``, ``[gate | up]``) loading from unfused checkpoint keys
through ``load_weights``: each segment through the layer's ``load_segment``, the fused
parameter covered only once all its segments are, at TP=1 and per rank at TP=2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.distributed import ParallelState, use_parallel
from mstar.layers.linear import QKVParallelLinear
from mstar.layers.mlp import SwiGLU
from mstar.model.weights import WeightLoadError, load_weights
from tests.distributed.helpers import fake_tp_group


def randomised(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


class Attn(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        if fused:
            self.qkv_proj = QKVParallelLinear(6, 2, 4, 2, bias=True, segment_names=("q_proj", "k_proj", "v_proj"))
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(6, 8), nn.Linear(6, 4), nn.Linear(6, 4)


def test_fused_swiglu_loads_the_unfused_checkpoint_and_matches_it():
    ref = randomised(SwiGLU(12, 20, bias=True), 1)
    fused = SwiGLU(12, 20, bias=True, fused=True)
    assert set(dict(fused.named_parameters())) == {"gate_up_proj.weight", "gate_up_proj.bias",
                                                   "down_proj.weight", "down_proj.bias"}
    load_weights(fused, ref.state_dict().items())
    assert torch.equal(fused.gate_up_proj.weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
    x = torch.randn(5, 12)
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-6, atol=1e-6)
    again = SwiGLU(12, 20, bias=True, fused=True)  # a fused checkpoint (our own state dict) loads too
    load_weights(again, fused.state_dict().items())
    assert torch.equal(again(x), fused(x))


def test_fused_qkv_is_covered_only_when_every_segment_is():
    ref = randomised(Attn(fused=False), 2)
    state = ref.state_dict()
    fused = Attn(fused=True)
    load_weights(fused, state.items())
    x = torch.randn(3, 6)
    q, k, v = fused.qkv_proj.split_output(fused.qkv_proj(x))
    for ours, theirs in ((q, ref.q_proj), (k, ref.k_proj), (v, ref.v_proj)):
        torch.testing.assert_close(ours, theirs(x), rtol=1e-6, atol=1e-6)

    partial = {n: t for n, t in state.items() if n != "v_proj.weight"}
    with pytest.raises(WeightLoadError, match=r"did not fill \(1: v_proj\.weight\)") as err:
        load_weights(Attn(fused=True), partial.items())
    assert "qkv_proj.weight" not in str(err.value)
    load_weights(Attn(fused=True), partial.items(), strict=False)  # not strict: no complaint

    no_bias = {n: t for n, t in state.items() if not n.endswith("bias")}
    with pytest.raises(WeightLoadError, match=r"did not fill \(1: qkv_proj\.bias\)"):
        load_weights(Attn(fused=True), no_bias.items())

    wrong = dict(state, **{"k_proj.weight": torch.zeros(6, 6)})
    with pytest.raises(WeightLoadError, match=r"segment 1 .*'k_proj\.weight'.*\(6, 6\)"):
        load_weights(Attn(fused=True), wrong.items())


@pytest.mark.parametrize("size", [2, 4])
def test_segments_load_this_ranks_shard(size):
    ref = randomised(SwiGLU(6, 8, bias=True), 3)
    for rank in range(size):
        with use_parallel(ParallelState(tp=fake_tp_group(rank, size))):
            mlp = SwiGLU(6, 8, bias=True, fused=True)
        load_weights(mlp, ref.state_dict().items())
        gate, up = mlp.gate_up_proj.weight.split(mlp.gate_up_proj.local_sizes)
        assert torch.equal(gate, ref.gate_proj.weight.chunk(size)[rank])
        assert torch.equal(up, ref.up_proj.weight.chunk(size)[rank])
        assert torch.equal(mlp.down_proj.weight, ref.down_proj.weight.chunk(size, dim=1)[rank])
