"""Triton, when it is installed: the one place our kernel modules import it from.

``HAS_TRITON`` says whether it is (without it ``triton`` and ``tl`` are None and the kernel
modules still import, their functions refusing to run); ``INTERPRET`` whether kernels are
built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before the first import).

**Programmatic dependent launch** (PDL, Hopper and later): a decode step is hundreds of short
kernels in a row, and between two of them the GPU drains the first (its last programs finish
one by one) before it starts the second. Launched with PDL, a kernel may start while the one
before it is still running: each of our decode-path kernels first says its dependants may
start (``griddepcontrol.launch_dependents``), then does only work that reads nothing an
earlier kernel writes (the GEMVs fetch the first part of their weights into L2), then waits
for the kernel before it to finish and its writes to be visible (``griddepcontrol.wait``),
and only then reads its inputs and writes anything. ``pdl(x)`` says whether launches on
``x``'s device take it: CUDA at compute capability 9.0 or more, not under the interpreter,
and not switched off (``MSTAR_PDL=0``, or ``set_pdl``). A kernel launched this way after a
kernel that does not take part (cuBLAS, torch's) starts when that one ends, as without PDL.
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


_PDL_SETTING: bool | None = None if os.environ.get("MSTAR_PDL", "") == "" else os.environ["MSTAR_PDL"] != "0"
_PDL_PREFETCH_BYTES = int(os.environ.get("MSTAR_PDL_PREFETCH_BYTES", str(2 << 20)))
_PDL_LATE_TRIGGER = os.environ.get("MSTAR_PDL_LATE_TRIGGER", "1") != "0"
_pdl_devices: dict[int, bool] = {}


def set_pdl(enabled: bool | None, prefetch_bytes: int | None = None, late_trigger: bool | None = None) -> None:
    """Switch PDL launches on or off for the kernels launched from now on (``None``: where the
    device supports it); ``prefetch_bytes`` is how much of its weights a GEMV launch may fetch
    into L2 before it waits for the kernel before it (0: none); ``late_trigger``: a GEMV lets
    the next kernel start only after its main loop (else at its start). For benchmarks and
    tests: a captured CUDA graph keeps the launches it was captured with."""
    global _PDL_SETTING, _PDL_PREFETCH_BYTES, _PDL_LATE_TRIGGER
    _PDL_SETTING = enabled
    if prefetch_bytes is not None:
        _PDL_PREFETCH_BYTES = prefetch_bytes
    if late_trigger is not None:
        _PDL_LATE_TRIGGER = late_trigger


def pdl_late_trigger() -> bool:
    """Whether a GEMV lets the next kernel start only after its main loop (PDL launches)."""
    return _PDL_LATE_TRIGGER


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels launched on ``x``'s device take programmatic dependent launch."""
    if INTERPRET or not x.is_cuda or _PDL_SETTING is False:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    supported = _pdl_devices.get(index)
    if supported is None:
        supported = _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return supported


def pdl_prefetch_bytes() -> int:
    """The bytes of weights a GEMV launch may fetch into L2 before its wait (PDL launches only)."""
    return max(0, _PDL_PREFETCH_BYTES)


def launch_options(enabled: bool) -> dict[str, bool]:
    """The launch keyword for a kernel call: ``launch_pdl=True`` when ``enabled`` (the kernel
    must then wait with ``griddepcontrol.wait`` before it touches another kernel's data)."""
    return {"launch_pdl": True} if enabled else {}


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


if HAS_TRITON:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A PDL kernel's opening: let the next kernel start (it waits for this one before it
        reads anything)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the kernel before this one to finish and its writes to be visible: before
        the first read of another kernel's output and the first write (PDL launches only)."""
        if PDL:
            tl.extra.cuda.gdc_wait()

else:  # pragma: no cover - exercised only where Triton is missing
    pdl_start = pdl_wait = None


__all__ = ["HAS_TRITON", "INTERPRET", "as_rows", "check_runnable", "launch_options", "pdl", "pdl_late_trigger",
           "pdl_prefetch_bytes",
           "pdl_start", "pdl_wait", "set_pdl", "tl", "triton"]
