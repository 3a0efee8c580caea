"""Weights fetched into L2 from a side stream while the decode step's small kernels run.

At a few rows a decode layer's time is its projections' weight reads; between them the
rotary kernel, the attention and its combine, the add + norms read next to nothing, and the
memory bus idles for those microseconds. ``L2Prefetch.fetch`` forks a side stream at that
point (it waits for what the main stream has launched so far), where one kernel asks L2 for
the first part of the next projection's weights (``prefetch.global.L2``, no registers, no
result); the main stream goes on, and the projection's kernel then finds those lines in L2.
``join`` makes the main stream wait for the side stream again (a captured CUDA graph must end
joined), once a layer.

What is fetched of a ``[N, K]`` weight is the first ``fraction`` of every row, so that every
program of a GEMV (each owns some rows and walks their K from the start) starts on lines
already in L2. A prefetch changes no value: the step's results are bit for bit those without
it. ``PrefetchPlan`` says how much of which projection; the Llama decoder takes
``mstar.model.llama.modeling.L2_PREFETCH`` (``MSTAR_L2_PREFETCH``, see ``PrefetchPlan.parse``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mstar.layers.triton_support import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _l2_prefetch_kernel(W, N, stride_w, ROW_LINES: tl.constexpr, LINES: tl.constexpr, BLOCK_R: tl.constexpr):
        """Ask L2 for the first ``ROW_LINES`` 128-byte lines (``LINES``: the next power of
        two) of ``BLOCK_R`` rows of ``W`` from this program's first row."""
        LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
        rows = tl.minimum(tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), N - 1)
        cols = tl.minimum(tl.arange(0, LINES), ROW_LINES - 1) * LINE
        ptrs = W + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def l2_prefetch(weight: torch.Tensor, fraction: float) -> None:
    """Launch, on the current stream, one kernel that asks L2 for the first ``fraction`` of
    every row of the 2D CUDA tensor ``weight`` (a no-op for 0 or a CPU tensor)."""
    if fraction <= 0 or not weight.is_cuda or not HAS_TRITON:
        return
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"l2_prefetch takes a row-major 2D weight, got shape {tuple(weight.shape)}")
    line = 128 // weight.element_size()
    row_lines = max(1, round(min(1.0, fraction) * -(-weight.shape[1] // line)))
    lines = triton.next_power_of_2(row_lines)
    block_r = max(1, min(64, 4096 // lines))
    n = weight.shape[0]
    _l2_prefetch_kernel[(triton.cdiv(n, block_r),)](weight, n, weight.stride(0), ROW_LINES=row_lines, LINES=lines,
                                                     BLOCK_R=block_r, num_warps=4)


@dataclass(frozen=True)
class PrefetchPlan:
    """The fraction of each projection's weight rows fetched into L2 before its kernel, and
    up to how many rows a step takes it (0: off). ``qkv`` is fetched at the layer's start
    (beside its add + norm), ``o`` after qkv (beside RoPE and the attention), ``gate_up``
    after o (beside the add + norm)."""

    qkv: float = 0.0
    o: float = 0.0
    gate_up: float = 0.0
    max_rows: int = 0

    @property
    def active(self) -> bool:
        return self.max_rows > 0 and (self.qkv > 0 or self.o > 0 or self.gate_up > 0)

    @classmethod
    def parse(cls, text: str) -> PrefetchPlan:
        """``"o=1,gate_up=0.25,qkv=0.25,max_rows=2"`` (empty or ``off``: no prefetch). A key a plan
        does not have is refused by name."""
        if text.strip() in ("", "off", "0"):
            return cls()
        known = [f.name for f in fields(cls)]
        values: dict[str, float | int] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in known:
                raise ValueError(f"unknown L2 prefetch key {key!r} (known: {', '.join(known)})")
            values[key] = int(value) if key == "max_rows" else float(value)
        return cls(**values)  # type: ignore[arg-type]


class L2Prefetch:
    """A side stream for ``l2_prefetch`` launches forked off the current stream (``fetch``) and
    joined back (``join``); on CPU tensors both do nothing."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._forked: torch.cuda.Stream | None = None

    def fetch(self, weight: torch.Tensor, fraction: float) -> None:
        if fraction <= 0 or not weight.is_cuda:
            return
        main = torch.cuda.current_stream(weight.device)
        side = self._streams.get(weight.device)
        if side is None:
            side = self._streams[weight.device] = torch.cuda.Stream(weight.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            l2_prefetch(weight, fraction)
        self._forked = side

    def join(self) -> None:
        if self._forked is not None:
            torch.cuda.current_stream(self._forked.device).wait_stream(self._forked)
            self._forked = None


__all__ = ["L2Prefetch", "PrefetchPlan", "l2_prefetch"]
