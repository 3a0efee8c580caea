"""Run a function on N CPU processes joined by a gloo process group (tests only).

``run_ranks(fn, n, *args)`` spawns ``n`` processes; each joins the group, calls
``fn(rank, n, *args)`` and hands its return value back (``torch.save``), so the test
asserts in the parent. A process that raises fails the call with its traceback.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mstar.distributed import Group, ParallelState, build_mesh, init_distributed


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``[fn(0, n, *args), ..., fn(n - 1, n, *args)]``, each run in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        context = mp.start_processes(_entry, args=(fn, world_size, init_method, tmp, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s")
        return [torch.load(os.path.join(tmp, f"result-{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, init_method: str, out_dir: str,
           args: tuple) -> None:
    torch.set_num_threads(1)  # the machine's cores are shared by every rank
    init_distributed(rank, world_size, init_method, "cpu")  # gloo
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"result-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def mesh(tp_size: int, sp_size: int = 1) -> ParallelState:
    """This process's state in a ``tp x sp`` mesh over the whole world."""
    state = build_mesh(range(dist.get_world_size()), tp_size, sp_size)
    assert state is not None
    return state


def fake_tp_group(rank: int, size: int) -> Group:
    """A TP group that never communicates: for building one rank's layers in a single
    process to check how they shard weights (no forward through collectives)."""
    return Group(rank, size, tuple(range(size)), process_group=object())


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference magnitude."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours - ref).abs().max() / ref.abs().max()).item()
