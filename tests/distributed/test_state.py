"""The parallel state: single-rank default, scoped use, mesh shape checks, and collectives
that are the identity on one rank (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from mstar.distributed import (
    SINGLE,
    Group,
    ParallelState,
    all_gather,
    all_reduce,
    all_to_all,
    build_mesh,
    current_parallel,
    sizes_of_ranks,
    use_parallel,
)
from mstar.layers.linear import ColumnParallelLinear
from tests.distributed.helpers import fake_tp_group


def test_layers_take_the_state_of_the_scope_they_are_built_in():
    assert current_parallel() is SINGLE and SINGLE.is_single
    outer, inner = ParallelState(tp=fake_tp_group(0, 2)), ParallelState(tp=fake_tp_group(1, 4))
    with use_parallel(outer):
        with use_parallel(inner):
            deep = ColumnParallelLinear(4, 8)
        shallow = ColumnParallelLinear(4, 8)
    assert current_parallel() is SINGLE
    assert (deep.tp.rank, deep.tp.size, deep.out_features) == (1, 4, 2)
    assert (shallow.tp.rank, shallow.tp.size, shallow.out_features) == (0, 2, 4)
    assert ColumnParallelLinear(4, 8).out_features == 8


def test_collectives_are_the_identity_on_one_rank():
    x = torch.randn(2, 3, 4)
    one = Group()
    assert all_reduce(x, one) is x and all_gather(x, one) is x
    assert all_to_all(x, one, scatter_dim=2, gather_dim=1) is x
    assert sizes_of_ranks(3, one) == [3]


def test_groups_and_meshes_refuse_impossible_shapes():
    with pytest.raises(ValueError, match="needs a process group"):
        Group(0, 2, (0, 1))
    with pytest.raises(ValueError, match="rank 2 of a group of 2"):
        Group(2, 2, (0, 1), process_group=object())
    with pytest.raises(ValueError, match="tp_size 2 x sp_size 2 needs 4 ranks"):
        build_mesh([0, 1], 2, 2)
    with pytest.raises(ValueError, match="name a rank twice"):
        build_mesh([0, 0], 2, 1)
