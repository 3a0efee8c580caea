"""The fused small-batch GEMV kernels against cuBLAS plus the separate fused kernels, on the
projections of one Llama-3.1-8B decoder layer (bf16, hidden 4096, 32 + 2 x 8 heads of 128,
MLP 14336).

For each row count and projection: (a) what a decode step runs now, ``add_rmsnorm`` +
``F.linear`` (+ ``silu_and_mul``), and (b) the fused kernel of ``mstar.layers.triton_gemv``.
Both are timed inside a CUDA graph of many launches that cycle through enough copies of the
weight to overflow the L2 cache (as 32 layers of a real step do), replayed several times;
the line gives microseconds per launch and the effective weight-read bandwidth, then the
per-layer sums of (a) and (b). (b) is checked against (a) (max error relative to the
largest magnitude of (a)); any failure exits non-zero. On an H200, in about a minute:

    python benchmarks/check_gemv.py              # rows 1, 2, 4, 8
    python benchmarks/check_gemv.py --sweep      # also time candidate launch configs
    python benchmarks/check_gemv.py --smoke      # tiny shapes on the CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

HIDDEN, QKV, INNER, EPS = 4096, 6144, 14336, 1e-5
TINY = dict(hidden=96, qkv=160, inner=72)  # --smoke: not multiples of the interpreter's blocks
TOLERANCE = 2e-2  # bf16: an ulp of the output plus reduction order
L2_BYTES = 60 << 20
SWEEP = [(16, 256, 4, 4), (32, 128, 4, 6), (32, 256, 4, 4), (32, 256, 4, 5), (32, 512, 4, 3), (64, 64, 4, 6),
         (64, 128, 4, 4), (64, 128, 4, 5), (64, 128, 8, 4), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3)]


@dataclass
class Case:
    """One projection: the unfused and fused calls on weight copy ``i``, and the bytes read."""

    name: str
    unfused: Callable[[int], torch.Tensor]
    fused: Callable[[int], torch.Tensor]
    fused_with: Callable[[int, object], torch.Tensor]  # with a launch config (sweeps)
    weight_bytes: int
    copies: int


def make_cases(rows: int, device: torch.device, dtype: torch.dtype, hidden: int, qkv: int, inner: int) -> list[Case]:
    import torch.nn.functional as F

    from mstar.layers.triton_fused import add_rmsnorm, silu_and_mul
    from mstar.layers.triton_gemv import gemv, rmsnorm_gemv

    gen = torch.Generator(device="cpu").manual_seed(rows)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    def weights(n: int, k: int) -> list[torch.Tensor]:
        copies = max(2, -(-3 * L2_BYTES // (n * k * 2))) if device.type == "cuda" else 1
        first = rand(n, k, scale=k**-0.5)
        return [first] + [first.roll(i, dims=0).clone() for i in range(1, copies)]

    x, residual, attn, act = rand(rows, hidden), rand(rows, hidden), rand(rows, hidden), rand(rows, inner)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    w_qkv, w_o, w_gate_up, w_down = weights(qkv, hidden), weights(hidden, hidden), weights(2 * inner, hidden), \
        weights(hidden, inner)

    def qkv_unfused(i: int) -> torch.Tensor:
        normed, _ = add_rmsnorm(x, residual, norm_w, EPS)
        return F.linear(normed, w_qkv[i])

    def gate_up_unfused(i: int) -> torch.Tensor:
        normed, _ = add_rmsnorm(x, residual, norm_w, EPS)
        return silu_and_mul(F.linear(normed, w_gate_up[i]))

    def case(name: str, unfused, fused, ws: list[torch.Tensor]) -> Case:
        return Case(name, unfused, lambda i: fused(i, None), fused, ws[0].numel() * ws[0].element_size(), len(ws))

    return [
        case("qkv  rmsnorm+gemv", qkv_unfused,
             lambda i, c: rmsnorm_gemv(x, residual, norm_w, EPS, w_qkv[i], config=c)[0], w_qkv),
        case("o    gemv", lambda i: F.linear(attn, w_o[i]), lambda i, c: gemv(attn, w_o[i], config=c), w_o),
        case("gate_up rmsnorm+gemv+silu", gate_up_unfused,
             lambda i, c: rmsnorm_gemv(x, residual, norm_w, EPS, w_gate_up[i], silu_mul=True, config=c)[0],
             w_gate_up),
        case("down gemv", lambda i: F.linear(act, w_down[i]), lambda i, c: gemv(act, w_down[i], config=c), w_down),
    ]


def graph_us(step: Callable[[int], torch.Tensor], copies: int, launches: int = 24, replays: int = 15) -> float:
    """Median microseconds per launch of ``launches`` calls (cycling the weight copies)
    captured in one CUDA graph."""
    for i in range(copies):  # compile and pick kernels outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(launches):
            step(j % copies)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def run(rows_list: list[int], device: torch.device, smoke: bool) -> bool:
    dtype = torch.float32 if smoke else torch.bfloat16
    sizes = TINY if smoke else dict(hidden=HIDDEN, qkv=QKV, inner=INNER)
    ok = True
    for rows in rows_list:
        total_a = total_b = 0.0
        for case in make_cases(rows, device, dtype, **sizes):
            err = rel_err(case.fused(0), case.unfused(0))
            good = err <= (1e-5 if smoke else TOLERANCE)
            ok &= good
            if smoke:
                start = time.perf_counter()
                case.fused(0)
                line = f"interpreted in {time.perf_counter() - start:.2f} s"
            else:
                a, b = graph_us(case.unfused, case.copies), graph_us(case.fused, case.copies)
                total_a, total_b = total_a + a, total_b + b
                line = (f"(a) {a:7.1f} us {case.weight_bytes / a / 1e6:5.2f} TB/s  "
                        f"(b) {b:7.1f} us {case.weight_bytes / b / 1e6:5.2f} TB/s  x{a / b:5.2f}")
            print(f"{'ok  ' if good else 'FAIL'} M={rows:<2} {case.name:<26} rel err {err:.1e}  {line}", flush=True)
        if not smoke:
            print(f"     M={rows:<2} per layer: (a) {total_a:7.1f} us  (b) {total_b:7.1f} us  "
                  f"saves {total_a - total_b:6.1f} us/layer, {32 * (total_a - total_b) / 1e3:.3f} ms/step of 32 layers",
                  flush=True)
    return ok


def sweep(rows_list: list[int], device: torch.device) -> None:
    """Time every candidate launch config of every fused kernel; print the best few."""
    from mstar.layers.triton_gemv import GemvConfig

    for rows in rows_list:
        for case in make_cases(rows, device, torch.bfloat16, HIDDEN, QKV, INNER):
            results = []
            for bn, bk, warps, stages in SWEEP:
                config = GemvConfig(bn, bk, warps, stages)
                try:
                    us = graph_us(lambda i, case=case, config=config: case.fused_with(i, config),
                                  case.copies, replays=7)
                except Exception as error:  # out of shared memory or registers: not a candidate
                    print(f"     skip {config}: {type(error).__name__}", flush=True)
                    continue
                results.append((us, bn, bk, warps, stages))
            results.sort()
            best = "  ".join(f"{bn}/{bk}/w{w}/s{s} {us:.1f}us {case.weight_bytes / us / 1e6:.2f}TB/s"
                             for us, bn, bk, w, s in results[:4])
            print(f"sweep M={rows:<2} {case.name:<26} {best}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--sweep", action="store_true", help="also time candidate launch configs")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    args = parser.parse_args()
    if args.smoke:  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    else:
        print("needs a CUDA GPU (or --smoke)")
        return 1
    rows = args.rows or ([1, 3] if args.smoke else [1, 2, 4, 8])
    ok = run(rows, device, args.smoke)
    if args.sweep and not args.smoke:
        sweep([1, 4], device)
    print("all ok" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
