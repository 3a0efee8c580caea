"""Triton, when it is installed: the one place our kernel modules import it from.

``HAS_TRITON`` says whether it is (without it ``triton`` and ``tl`` are None and the kernel
modules still import, their functions refusing to run); ``INTERPRET`` whether kernels are
built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before the first import).
"""

from __future__ import annotations

import os

import torch

try:  # optional dependency
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(x: torch.Tensor, kernels: str, module: str) -> None:
    """Refuse, naming why, to launch ``kernels`` (of ``module``) on ``x`` where they cannot run:
    without Triton, or on CPU tensors outside the interpreter."""
    if not HAS_TRITON:
        raise RuntimeError(f"{kernels} need the triton package")
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError(f"{kernels} need CUDA tensors (or TRITON_INTERPRET=1 set before {module} is imported)")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a contiguous last dimension (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


__all__ = ["HAS_TRITON", "INTERPRET", "as_rows", "check_runnable", "tl", "triton"]
