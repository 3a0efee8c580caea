"""Run a function on N processes joined by one process group (tests only).

``run_ranks(fn, n, *args)`` spawns ``n`` CPU processes joined by gloo; each calls
``fn(rank, n, *args)`` and hands its return value back (``torch.save``), so the test
asserts in the parent. A process that raises fails the call with its traceback.
``run_ranks(fn, n, *args, device="cuda")`` gives rank ``r`` the GPU ``cuda:r`` and joins
the ranks over NCCL instead, in strict float32 (TF32 off, see ``strict_fp32``); ``fn``
builds its models on that GPU and the results come back on the CPU.

``devices(n)`` parametrizes a test over ``"cpu"`` and ``"cuda"``, the latter skipped (before
any fixture or model is built) on a machine with fewer than ``n`` GPUs (``needs_cuda``).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mstar.distributed import Group, ParallelState, build_mesh, init_distributed
from tests.support.markers import needs_cuda


def devices(gpus: int) -> list:
    """``["cpu", "cuda"]`` as test parameters, ``"cuda"`` needing ``gpus`` GPUs (NCCL needs one
    per rank)."""
    return ["cpu", pytest.param("cuda", marks=needs_cuda(count=gpus))]


def rank_device(device: str, rank: int) -> torch.device:
    """The device rank ``rank`` computes on: the CPU, or its own GPU ``cuda:rank``."""
    return torch.device("cpu") if device == "cpu" else torch.device(device, rank)


def strict_fp32() -> None:
    """float32 maths without TF32 in this process, for its whole life (a rank of
    ``run_ranks``): cuBLAS matmuls and cuDNN convolutions round nothing to TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@contextmanager
def fp32_only(device: str) -> Iterator[None]:
    """Within the block, on ``cuda``: no TF32 in this process (torch's switches) nor in the
    processes it spawns (worker processes, ``mstar serve``), which inherit
    ``NVIDIA_TF32_OVERRIDE=0`` (cuBLAS and cuDNN read it; torch's switches cannot reach
    them). Everything is restored afterwards. Nothing changes on the CPU."""
    if device == "cpu":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             os.environ.get("NVIDIA_TF32_OVERRIDE"))
    strict_fp32()
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        if saved[2] is None:
            os.environ.pop("NVIDIA_TF32_OVERRIDE", None)
        else:
            os.environ["NVIDIA_TF32_OVERRIDE"] = saved[2]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              device: str = "cpu") -> list[Any]:
    """``[fn(0, n, *args), ..., fn(n - 1, n, *args)]``, each run in its own process, over
    gloo on the CPU or over NCCL with one GPU per rank (``device="cuda"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        entry = _entry if device == "cpu" else _cuda_entry
        context = mp.start_processes(entry, args=(fn, world_size, init_method, tmp, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s")
        if device != "cpu":  # the ranks' tensors may be on their GPUs: bring them here
            return [torch.load(os.path.join(tmp, f"result-{rank}.pt"), weights_only=False, map_location="cpu")
                    for rank in range(world_size)]
        return [torch.load(os.path.join(tmp, f"result-{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def _cuda_entry(rank: int, fn: Callable[..., Any], world_size: int, init_method: str, out_dir: str,
                args: tuple) -> None:
    torch.cuda.set_device(rank)
    strict_fp32()
    init_distributed(rank, world_size, init_method, torch.device("cuda", rank))  # NCCL
    try:
        result = fn(rank, world_size, *args)
        torch.cuda.synchronize()
        torch.save(result, os.path.join(out_dir, f"result-{rank}.pt"))
    finally:
        dist.destroy_process_group()


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


def check_two_gpu_config(name: str, model_path: str, split: tuple[int, int], walks: tuple[str, ...]) -> None:
    """``configs/<name>``, a two-GPU deployment splitting the ``dit`` node ``split = (tp_size,
    sp_size)`` ways, places on the CPU with ``model_path`` (no GPU here): the split passes the
    model's head checks and the group's leader, rank 0, runs ``dit`` in every walk of ``walks``."""
    from mstar.config import load_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    path = Path(__file__).resolve().parents[2] / "configs" / name
    assert load_config(path).device == "cuda"
    config = load_config(path, {"device": "cpu", "model_path": model_path})
    spec = model_class(config.model)(config)
    placement = build_placement(spec.graph(), config, spec)  # checks the split against the heads
    group = next(g for g in config.node_groups if "dit" in g.node_names)
    assert (group.tp_size, group.sp_size) == split and list(group.ranks) == [0, 1]
    for walk in walks:
        assert placement.rank_of(walk, "dit") == 0
    assert config.num_ranks == 2
