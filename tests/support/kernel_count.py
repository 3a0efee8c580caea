"""Counting the device kernels a step launches, on the CPU.

A decode step small enough to be bound by its kernel count (Whisper's one-clip step) should
not gain kernels unnoticed. Without a GPU the count is read off what a GPU run would launch:
the ATen compute ops (through a ``TorchDispatchMode``: every op except views, allocations and
the like, each of which is one kernel or more on CUDA), plus every launch of one of our Triton
kernels (``kernel[grid](...)``: the module attributes named ``*_kernel`` of the modules given,
wrapped for the count's duration). The ATen ops the Triton interpreter itself runs inside a
launch (copying arguments in and out) are not counted.

    with KernelCount(triton_gemv, triton_attention) as seen:
        layer.forward_fused(...)
    assert seen.total() <= 8, seen.report()

A CPU count is a lower bound of the GPU's: cuBLAS may split one GEMM into a split-K kernel
and its reduce, and a Triton launch on the CPU may take another path than on the GPU where
the grid depends on the device (``_num_sms``).
"""

from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ATen ops that launch no kernel on CUDA: allocations and metadata.
_FREE = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.alias.default,
}


class _CountedLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts, then launches it."""

    def __init__(self, kernel: Any, name: str, count: KernelCount) -> None:
        self._kernel, self._name, self._count = kernel, name, count

    def __getitem__(self, grid: Any) -> Any:
        launch = self._kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self._count.kernels[f"triton:{self._name}"] += 1
            self._count.inside_triton += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self._count.inside_triton -= 1

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


class KernelCount(TorchDispatchMode):
    """Kernels launched inside the ``with`` block, by name (``triton:<kernel>`` or the ATen op)."""

    def __init__(self, *triton_modules: ModuleType) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.inside_triton = 0
        self._modules = triton_modules
        self._saved: list[tuple[ModuleType, str, Any]] = []

    def __enter__(self) -> KernelCount:
        for module in self._modules:
            for name, value in list(vars(module).items()):
                if name.endswith("_kernel") and hasattr(value, "__getitem__"):
                    self._saved.append((module, name, value))
                    setattr(module, name, _CountedLaunch(value, name, self))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for module, name, value in reversed(self._saved):
                setattr(module, name, value)
            self._saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_triton and func not in _FREE and not func.is_view:
            self.kernels[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.kernels.values())

    def report(self) -> str:
        return f"{self.total()} kernels: " + ", ".join(f"{name} x{n}" for name, n in sorted(self.kernels.items()))
