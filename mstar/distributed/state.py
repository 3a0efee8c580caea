"""Which process groups a component is split over: tensor parallel (TP) and Ulysses
sequence parallel (SP), as a TP x SP mesh.

Layers read the state once, when they are built, from a scoped context::

    with use_parallel(state):
        model = LlamaForCausalLM(config)   # each layer keeps its shard and its group

Outside any ``use_parallel`` the state is ``SINGLE`` (one rank, no process group), so a
model built without it is the plain single-device model and every collective is the
identity. Building a real state takes ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """One process group as a layer sees it: this process's rank in it and its size.

    ``ranks`` are the global ranks of the members in group order; ``process_group`` is the
    ``torch.distributed`` group (None when the group has one member: nothing to talk to).
    """

    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    process_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or len(self.ranks) != self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size} with members {self.ranks}")
        if self.size > 1 and self.process_group is None:
            raise ValueError(f"a group of {self.size} ranks needs a process group")


@dataclass(frozen=True)
class ParallelState:
    """The TP and SP groups of this process for one component.

    In the mesh of ``tp x sp`` ranks, TP is the inner dimension: the ranks
    ``ranks[s * tp : (s + 1) * tp]`` split heads and weights of the same sequence shard ``s``,
    and ``ranks[t::tp]`` hold the same heads of different sequence shards.
    """

    tp: Group = Group()
    sp: Group = Group()

    @property
    def is_single(self) -> bool:
        return self.tp.size == 1 and self.sp.size == 1


SINGLE = ParallelState()

_current: ContextVar[ParallelState] = ContextVar("mstar_parallel_state", default=SINGLE)


def current_parallel() -> ParallelState:
    """The state layers built now are split by (``SINGLE`` outside ``use_parallel``)."""
    return _current.get()


@contextmanager
def use_parallel(state: ParallelState) -> Iterator[ParallelState]:
    """Layers built inside this block shard themselves over ``state``'s groups."""
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device | str,
                     timeout: timedelta | None = None) -> None:
    """Join the process group of every worker: gloo on the CPU, NCCL on CUDA.

    ``init_method`` is a ``torch.distributed`` rendezvous URL (``tcp://host:port`` or
    ``file:///path``) the launcher chose and handed to every worker. ``timeout`` bounds the
    rendezvous (a member that never comes fails the others) and is the default timeout of
    the collectives of every group created afterwards (torch's default when None).
    """
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    extra = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **extra)


def build_mesh(ranks: Sequence[int], tp_size: int, sp_size: int) -> ParallelState | None:
    """The TP x SP state of this process in the mesh over the global ``ranks``.

    Creating process groups is collective over the whole world: every process must call
    ``build_mesh`` for every mesh of the deployment, with the same arguments and in the same
    order, whether it belongs to the mesh or not. Returns None in a process outside ``ranks``.
    """
    ranks = tuple(ranks)
    if len(ranks) != tp_size * sp_size:
        raise ValueError(f"tp_size {tp_size} x sp_size {sp_size} needs {tp_size * sp_size} ranks, got {ranks}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {ranks} name a rank twice")
    me = dist.get_rank() if dist.is_initialized() else 0
    tp_groups = [ranks[s * tp_size:(s + 1) * tp_size] for s in range(sp_size)]
    sp_groups = [ranks[t::tp_size] for t in range(tp_size)]
    tp = _member_group(tp_groups, me)
    sp = _member_group(sp_groups, me)
    if tp is None or sp is None:
        return None
    return ParallelState(tp=tp, sp=sp)


def _member_group(groups: list[tuple[int, ...]], me: int) -> Group | None:
    """Create every group (collective: all processes, same order) and return ``me``'s."""
    mine = None
    for members in groups:
        process_group = dist.new_group(list(members)) if len(members) > 1 else None
        if me in members:
            mine = Group(members.index(me), len(members), members, process_group)
    return mine
