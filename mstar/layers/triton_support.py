"""Triton, when it is installed: the one place our kernel modules import it from.

``HAS_TRITON`` says whether it is (without it ``triton`` and ``tl`` are None and the kernel
modules still import, their functions refusing to run); ``INTERPRET`` whether kernels are
built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before the first import).
"""

from __future__ import annotations

import os

try:  # optional dependency
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

__all__ = ["HAS_TRITON", "INTERPRET", "tl", "triton"]
