"""Tensor and sequence parallelism: process groups, collectives and the scoped state that
parallel layers (``mstar.layers.linear``, ``mstar.layers.ulysses``) are built under."""

from mstar.distributed.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    sizes_of_ranks,
)
from mstar.distributed.dims import ParallelDims
from mstar.distributed.state import (
    SINGLE,
    Group,
    ParallelState,
    build_mesh,
    current_parallel,
    init_distributed,
    use_parallel,
)

__all__ = [
    "SINGLE",
    "Group",
    "ParallelDims",
    "ParallelState",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "build_mesh",
    "current_parallel",
    "init_distributed",
    "sizes_of_ranks",
    "use_parallel",
]
