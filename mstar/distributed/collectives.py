"""Collectives over a ``Group``; each is the identity on a group of one rank, so layers call
them unconditionally and a single-device model runs no communication at all."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mstar.distributed.state import Group


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of ``x`` over the group (in place; returns ``x``)."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.process_group)
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` (all of one shape) concatenated along ``dim`` in rank order."""
    if group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.process_group)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Group rank ``src``'s ``x`` on every rank (in place; returns ``x``): e.g. the tokens
    the group's leader sampled, so every TP rank continues the same sequences."""
    if group.size == 1:
        return x
    dist.broadcast(x, group.ranks[src], group=group.process_group)
    return x


def sizes_of_ranks(n: int, group: Group) -> list[int]:
    """``n`` of every rank, in rank order (e.g. the sequence length each rank holds)."""
    if group.size == 1:
        return [n]
    sizes = torch.zeros(group.size, dtype=torch.int64, device=_device_of(group))
    sizes[group.rank] = n
    dist.all_reduce(sizes, group=group.process_group)
    return sizes.tolist()


def all_to_all(
    x: torch.Tensor,
    group: Group,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one piece per rank, send piece ``j`` to rank
    ``j``, and concatenate the pieces received along ``gather_dim`` in rank order.

    ``scatter_sizes`` (default: equal pieces) are the piece sizes along ``scatter_dim``;
    ``gather_sizes`` (default: this rank's size along ``gather_dim``, the same on every
    rank) are the sizes every rank holds along ``gather_dim``, so ranks may hold sequence
    shards of different lengths.
    """
    if group.size == 1:
        return x
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if scatter_dim == gather_dim:
        raise ValueError("all_to_all needs different scatter and gather dimensions")
    world = group.size
    if scatter_sizes is None:
        if x.shape[scatter_dim] % world:
            raise ValueError(f"cannot split dimension {scatter_dim} of size {x.shape[scatter_dim]} "
                             f"into {world} equal pieces")
        scatter_sizes = [x.shape[scatter_dim] // world] * world
    if gather_sizes is None:
        gather_sizes = [x.shape[gather_dim]] * world
    if len(scatter_sizes) != world or sum(scatter_sizes) != x.shape[scatter_dim]:
        raise ValueError(f"scatter sizes {list(scatter_sizes)} do not split {x.shape[scatter_dim]} over {world} ranks")
    if gather_sizes[group.rank] != x.shape[gather_dim]:
        raise ValueError(f"gather sizes {list(gather_sizes)} say rank {group.rank} holds "
                         f"{gather_sizes[group.rank]}, it holds {x.shape[gather_dim]}")

    # Flatten each outgoing piece, so pieces of any shape travel as one 1-D exchange.
    pieces = x.split(list(scatter_sizes), dim=scatter_dim)
    send = torch.cat([p.contiguous().view(-1) for p in pieces])
    shapes = []
    for size in gather_sizes:  # what rank j sends here: our scatter piece, its gather size
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[group.rank]
        shape[gather_dim] = size
        shapes.append(shape)
    counts = [_numel(s) for s in shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, output_split_sizes=counts,
                           input_split_sizes=[p.numel() for p in pieces], group=group.process_group)
    received = [chunk.view(shape) for chunk, shape in zip(recv.split(counts), shapes)]
    return torch.cat(received, dim=gather_dim)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _device_of(group: Group) -> torch.device:
    """The device a group's collectives run on (NCCL groups need CUDA tensors)."""
    if dist.get_backend(group.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
