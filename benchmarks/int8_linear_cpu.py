"""Int8 linear products on the CPU at Whisper base's shapes: which kernel ``quantization: int8`` uses.

Three ways to compute ``x @ W.T`` for ``x [M, K]`` and ``W [N, K]``:

* ``float32``: ``F.linear`` (the reference; oneDNN/MKL SGEMM);
* ``weight-only int8``: ``mstar.layers.quantized.Int8Weight`` (int8 codes, a scale per output
  row, ``aten._weight_int8pack_mm`` over bfloat16 activations);
* ``dynamic int8``: the activations rounded to int8 per row at each call (a scale per row),
  ``torch._int_mm`` (int8 x int8 -> int32), then both scales applied. The time includes the
  rounding of the activations.

Shapes: the encoder's (``M`` = 1500 frames of one 30 s window; 512 -> 512, 512 -> 2048,
2048 -> 512), the decoder's at one and eight rows, and the tied logits (512 -> 51865). Each
figure is the best of ``--repeats`` timings of ``--seconds`` each, in milliseconds per product,
with ``--threads`` intra-op threads (default 2: the CPU benchmark machine's cores).

    python benchmarks/int8_linear_cpu.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from mstar.layers.quantized import Int8Weight

SHAPES = [  # (what, M, K, N)
    ("encoder attention projection", 1500, 512, 512),
    ("encoder fc1", 1500, 512, 2048),
    ("encoder fc2", 1500, 2048, 512),
    ("decoder projection, 1 row", 1, 512, 512),
    ("decoder fc1, 1 row", 1, 512, 2048),
    ("decoder fc2, 1 row", 1, 2048, 512),
    ("decoder fc1, 8 rows", 8, 512, 2048),
    ("tied logits, 1 row", 1, 512, 51865),
    ("tied logits, 8 rows", 8, 512, 51865),
]


def dynamic_int8(x: torch.Tensor, codes_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with ``x`` rounded to int8 per row and ``W = scales[:, None] * codes``;
    ``codes_t``: the int8 codes ``[K, N]``."""
    row_scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / row_scale).round_().clamp_(-127, 127).to(torch.int8)
    return torch._int_mm(q, codes_t).float().mul_(row_scale).mul_(scales)


def best_ms(fn: Callable[[], object], seconds: float, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.3, help="length of one timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure (the best is kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, ms per product (best of {args.repeats})")
    print(f"| {'shape':30s} | M x K x N | float32 | weight-only int8 | dynamic int8 | rel. error w8 / dyn |")
    print("|---|---|---|---|---|---|")
    for what, m, k, n in SHAPES:
        weight, x = torch.randn(n, k) / k**0.5, torch.randn(m, k)
        q = Int8Weight.quantize(weight)
        codes_t, scales = q.codes.t(), q.scales.float()
        ref = F.linear(x, weight)
        err_w8 = ((q.linear(x) - ref).norm() / ref.norm()).item()
        err_dyn = ((dynamic_int8(x, codes_t, scales) - ref).norm() / ref.norm()).item()
        products = (partial(F.linear, x, weight), partial(q.linear, x), partial(dynamic_int8, x, codes_t, scales))
        times = [best_ms(fn, args.seconds, args.repeats) for fn in products]
        print(f"| {what:30s} | {m} x {k} x {n} | " + " | ".join(f"{t:.3f}" for t in times)
              + f" | {err_w8:.1e} / {err_dyn:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
