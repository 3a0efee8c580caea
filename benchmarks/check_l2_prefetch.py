"""Does a weight fetched into L2 beforehand make our GEMV faster? (``mstar.layers.triton_prefetch``)

For each Llama-3.1-8B projection shape (bf16) at ``--rows``: the GEMV's time with its weight
cold (L2 flushed by reading a 256 MB buffer), then after ``l2_prefetch`` of a fraction of it
(run to completion first, so the GEMV alone is timed), and the prefetch kernel's own time.
Medians of ``--repeats``, microseconds. On a GPU:

    python benchmarks/check_l2_prefetch.py --rows 1 64 --fractions 0.25 0.5 1
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, before) -> float:
    """Microseconds of ``fn`` on the GPU after ``before``. A spin kernel first keeps the GPU
    busy while the host launches ``fn``, so its launch latency is not timed."""
    before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000)  # ~0.1 ms
    start.record()
    fn()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end)


def fetched(cold, fetch) -> None:
    """L2 flushed, then the prefetch run to completion."""
    cold()
    fetch()
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from mstar.layers.triton_gemv import gemv
    from mstar.layers.triton_prefetch import l2_prefetch

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def cold() -> None:
        flush.add_(1)

    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for rows in args.rows:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            product = functools.partial(gemv, x, w, None, silu_mul=name == "gate_up")
            for _ in range(3):
                product()
            base = statistics.median(timed(product, cold) for _ in range(args.repeats))
            line = f"{name:8} rows {rows:3}: cold {base:6.1f} us ({n * k * 2 / base / 1e6:.2f} TB/s)"
            for fraction in args.fractions:
                fetch = functools.partial(l2_prefetch, w, fraction)
                warm = statistics.median(timed(product, functools.partial(fetched, cold, fetch))
                                         for _ in range(args.repeats))
                alone = statistics.median(timed(fetch, cold) for _ in range(args.repeats))
                line += f" | {fraction:g}: {warm:6.1f} us (prefetch {alone:5.1f})"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
