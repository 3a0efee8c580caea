"""The fused small-batch GEMV kernels against cuBLAS plus the separate fused kernels, on the
projections of one Llama-3.1-8B decoder layer (bf16, hidden 4096, 32 + 2 x 8 heads of 128,
MLP 14336), at the row counts of decode steps (1 to 64).

For each row count and projection, up to three ways of computing the same thing:

* (a) what a decode step runs without the GEMV path: ``add_rmsnorm`` + ``F.linear`` (cuBLAS)
  (+ ``silu_and_mul`` for gate_up);
* (b) one fused kernel of ``mstar.layers.triton_gemv``: ``rmsnorm_gemv`` (norm as a prologue
  of every program) for qkv and gate_up, ``gemv`` for o and down;
* (c) for qkv and gate_up only: ``add_rmsnorm``, then ``gemv`` (with the SiLU * up epilogue
  for gate_up): a separate norm pass instead of (b)'s prologue.

Each is timed inside a CUDA graph of many launches that cycle through enough copies of the
weight to overflow the L2 cache (as 32 layers of a real step do), replayed several times; a
line gives microseconds per launch and the weight-read bandwidth. Per row count the per-layer
sums follow: (a), ours (the faster of (b) and (c) per projection) and the best of all three per
projection (what the decoder's row rule picks). Every kernel output is checked against (a)
(max error relative to (a)'s largest magnitude); a failure exits non-zero. On an H200:

    python benchmarks/check_gemv.py                   # rows 1 2 4 8 16 32 64, about half a minute
    python benchmarks/check_gemv.py --sweep 64 32 16  # also time ~350 candidate configs (a minute)
    python benchmarks/check_gemv.py --sweep 64 32 16 --tma --confirm  # copy-engine candidates, then
                                                      # the table again with each kernel's faster config
    python benchmarks/check_gemv.py --smoke           # tiny shapes on the CPU, Triton's interpreter
    CHECK_GEMV_DIMS=3072,5120,8192 python benchmarks/check_gemv.py --rows 1 4  # another model's shapes

The kernels are compiled first in ``--workers`` processes at once. ``--json FILE`` writes
every timing as one JSON line (benchmarks/records has the H200's of 2026-12-03).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Llama-3.1-8B's by default; CHECK_GEMV_DIMS="3072,5120,8192" (hidden, qkv, MLP) times another
# model's projections (that one: Orpheus's 3B talker). An environment variable, not a flag, so
# that the sweep's compiling processes see the same shapes.
HIDDEN, QKV, INNER = (int(n) for n in os.environ.get("CHECK_GEMV_DIMS", "4096,6144,14336").split(","))
EPS = 1e-5
TINY = dict(hidden=96, qkv=160, inner=72)  # --smoke: not multiples of the interpreter's blocks
TOLERANCE = 2e-2  # bf16: an ulp of the output plus reduction order
L2_BYTES = 60 << 20
SMEM_BYTES = 220 << 10  # shared memory a config may take (an H200 block gets up to 227 KB)


@dataclass
class Case:
    """One projection's ways of computing it (``variants``: name -> call on weight copy ``i``
    with a launch config, None for the tuned default), the bytes read and the copies cycled."""

    name: str
    variants: dict[str, Callable[[int, object], torch.Tensor]]
    weight_bytes: int
    copies: int
    n_out: int
    k: int
    silu_mul: bool


def make_cases(rows: int, device: torch.device, dtype: torch.dtype, hidden: int, qkv: int, inner: int,
               copies: int | None = None) -> list[Case]:
    import torch.nn.functional as F

    from mstar.layers.triton_fused import add_rmsnorm, silu_and_mul
    from mstar.layers.triton_gemv import gemv, rmsnorm_gemv

    gen = torch.Generator(device=device).manual_seed(rows)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    def weights(n: int, k: int) -> list[torch.Tensor]:
        count = copies or (max(2, -(-3 * L2_BYTES // (n * k * 2))) if device.type == "cuda" else 1)
        first = rand(n, k, scale=k**-0.5)
        return [first] + [first.roll(i, dims=0).clone() for i in range(1, count)]

    x, residual, attn, act = rand(rows, hidden), rand(rows, hidden), rand(rows, hidden), rand(rows, inner)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    w_qkv, w_o, w_gate_up, w_down = weights(qkv, hidden), weights(hidden, hidden), weights(2 * inner, hidden), \
        weights(hidden, inner)

    def normed() -> torch.Tensor:
        return add_rmsnorm(x, residual, norm_w, EPS)[0]

    def case(name: str, ws: list[torch.Tensor], silu_mul: bool, **variants) -> Case:
        n, k = ws[0].shape
        return Case(name, variants, ws[0].numel() * ws[0].element_size(), len(ws), n // 2 if silu_mul else n, k,
                    silu_mul)

    return [
        case("qkv", w_qkv, False,
             a=lambda i, c: F.linear(normed(), w_qkv[i]),
             b=lambda i, c: rmsnorm_gemv(x, residual, norm_w, EPS, w_qkv[i], config=c)[0],
             c=lambda i, c: gemv(normed(), w_qkv[i], config=c)),
        case("o", w_o, False,
             a=lambda i, c: F.linear(attn, w_o[i]),
             b=lambda i, c: gemv(attn, w_o[i], config=c)),
        case("gate_up", w_gate_up, True,
             a=lambda i, c: silu_and_mul(F.linear(normed(), w_gate_up[i])),
             b=lambda i, c: rmsnorm_gemv(x, residual, norm_w, EPS, w_gate_up[i], silu_mul=True, config=c)[0],
             c=lambda i, c: gemv(normed(), w_gate_up[i], silu_mul=True, config=c)),
        case("down", w_down, False,
             a=lambda i, c: F.linear(act, w_down[i]),
             b=lambda i, c: gemv(act, w_down[i], config=c)),
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


def run(rows_list: list[int], device: torch.device, smoke: bool, log: Callable[[dict], None],
        configs: dict | None = None, label: str = "") -> tuple[bool, dict]:
    """Check and time every variant at every row count; ``configs`` maps ``(padded rows, case,
    variant)`` to a launch config replacing the default (row counts of 3 and up). Returns
    whether all were right, and the times by ``(rows, case, variant)``."""
    from mstar.layers.triton_gemv import padded_rows

    dtype = torch.float32 if smoke else torch.bfloat16
    sizes = TINY if smoke else dict(hidden=HIDDEN, qkv=QKV, inner=INNER)
    ok, all_times = True, {}
    for rows in rows_list:
        sums = {"a": 0.0, "ours": 0.0, "best": 0.0}
        for case in make_cases(rows, device, dtype, **sizes):
            ref = case.variants["a"](0, None)
            times, parts = {}, []
            for name, variant_call in case.variants.items():
                config = (configs or {}).get((padded_rows(rows), case.name, name)) if rows >= 3 else None

                def call(i: int, _: object, variant_call=variant_call, config=config) -> torch.Tensor:
                    return variant_call(i, config)

                err = 0.0 if name == "a" else rel_err(call(0, None), ref)
                good = err <= (1e-5 if smoke else TOLERANCE)
                ok &= good
                if smoke:
                    start = time.perf_counter()
                    call(0, None)
                    parts.append(f"({name}) {'ok' if good else 'FAIL'} {err:.1e} {time.perf_counter() - start:.2f} s")
                    continue
                us = times[name] = all_times[rows, case.name, name] = graph_us(lambda i, call=call: call(i, None),
                                                                                case.copies)
                log(dict(rows=rows, case=case.name, variant=name, us=us, tbs=case.weight_bytes / us / 1e6, err=err,
                         label=label, config=str(config)))
                parts.append(f"({name}) {us:6.1f} us {case.weight_bytes / us / 1e6:4.2f} TB/s{'' if good else ' FAIL'}")
            print(f"{label}M={rows:<2} {case.name:<8} " + "  ".join(parts), flush=True)
            if not smoke:
                ours = min(us for name, us in times.items() if name != "a")
                sums["a"] += times["a"]
                sums["ours"] += ours
                sums["best"] += min(ours, times["a"])
        if not smoke:
            log(dict(rows=rows, case="layer", label=label, **sums))
            print(f"{label}M={rows:<2} per layer: (a) {sums['a']:6.1f} us  ours {sums['ours']:6.1f} us  "
                  f"best {sums['best']:6.1f} us  saves {sums['a'] - sums['best']:5.1f} us/layer, "
                  f"{32 * (sums['a'] - sums['best']) / 1e3:.3f} ms/step of 32 layers", flush=True)
    return ok, all_times


# ------------------------------------------------------------------------------ sweep
SHAPES = {"qkv": (QKV, HIDDEN, False), "o": (HIDDEN, HIDDEN, False), "gate_up": (INNER, HIDDEN, True),
          "down": (HIDDEN, INNER, False)}  # name: (output features, K, SiLU * up epilogue)


def candidates(name: str, variant: str, rows: int, tma: bool = False) -> list:
    """Launch configs worth timing for one kernel: block shapes that fit shared memory at the
    deepest pipeline up to 6 stages (and at 3), and K splits that bring the programs to 1-5
    per SM (the norm prologue, run once per program, is never split)."""
    from mstar.layers.triton_gemv import SMS, GemvConfig, padded_rows

    n_out, k, silu_mul = SHAPES[name]
    m_rows, tiles_per_step = padded_rows(rows), 2 if silu_mul else 1
    configs = []
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            stages = min(6, SMEM_BYTES // (2 * bk * (bn * tiles_per_step + m_rows)))
            if stages < 2 or (variant == "b" and name in ("qkv", "gate_up") and bk == 64):
                continue
            tiles = -(-n_out // bn)
            splits = [s for s in (1, 2, 4, 8) if SMS <= tiles * s <= 4 * SMS and k % (s * bk) == 0] or [1]
            if variant == "b" and name in ("qkv", "gate_up"):
                splits = [1]
            for split in splits:
                for warps in ((4, 8) if bn * m_rows >= 64 * 64 and not tma else (4,)):
                    configs.append(GemvConfig(bn, bk, warps, stages, split, tma))
                    if stages > 4:
                        configs.append(GemvConfig(bn, bk, warps, 3, split, tma))
    return configs


def sweep_jobs(rows_list: list[int], tma: bool = False) -> list[tuple[int, str, str, object]]:
    """Every (rows, case, variant, config) of the sweep: (b) and (c) of every projection, but
    (b) of qkv and gate_up only up to 16 rows (its prologue re-reads all rows per program) and
    never with ``tma`` (weights through the copy engine: the separate-norm kernels only)."""
    jobs = []
    for rows in rows_list:
        for name in SHAPES:
            variants = ("b", "c") if name in ("qkv", "gate_up") else ("b",)
            for variant in variants:
                if variant == "b" and name in ("qkv", "gate_up") and (rows > 16 or tma):
                    continue
                jobs += [(rows, name, variant, c) for c in candidates(name, variant, rows, tma)]
    return jobs


def _compile(jobs: list[tuple[int, str, str, object]]) -> int:
    """Run each job once (the compile lands in Triton's on-disk cache); returns the failures."""
    failures, cases = 0, {}
    for rows, name, variant, config in jobs:
        if rows not in cases:
            cases = {rows: {c.name: c for c in make_cases(rows, torch.device("cuda"), torch.bfloat16, HIDDEN, QKV,
                                                          INNER, copies=1)}}
        try:
            cases[rows][name].variants[variant](0, config)
            torch.cuda.synchronize()
        except Exception:
            failures += 1
    return failures


def precompile(jobs: list[tuple[int, str, str, object]], workers: int) -> None:
    """Compile ``jobs`` in ``workers`` processes at once; Triton's on-disk cache then serves
    the timing process (compiling the sweep one kernel at a time would take minutes)."""
    import multiprocessing

    start = time.perf_counter()
    if workers > 1 and jobs:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            failures = sum(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))
        print(f"{len(jobs)} kernels compiled in {time.perf_counter() - start:.0f} s ({failures} failed)", flush=True)


def default_jobs(rows_list: list[int]) -> list[tuple[int, str, str, object]]:
    """The kernels of ``run``: every fused variant at its default config."""
    return [(rows, name, variant, None) for rows in rows_list for name in SHAPES
            for variant in (("b", "c") if name in ("qkv", "gate_up") else ("b",))]


def sweep(rows_list: list[int], log: Callable[[dict], None], tma: bool) -> dict:
    """Time every candidate config (compiled by ``precompile``), check it, and print the best
    four per kernel; returns the best ``(us, config)`` by ``(rows, case, variant)``."""
    jobs = sweep_jobs(rows_list, tma)
    results: dict[tuple[int, str, str], list] = {}
    for rows in rows_list:
        cases = {c.name: c for c in make_cases(rows, torch.device("cuda"), torch.bfloat16, HIDDEN, QKV, INNER)}
        refs = {name: c.variants["a"](0, None) for name, c in cases.items()}
        for job_rows, name, variant, config in jobs:
            if job_rows != rows:
                continue
            case, call = cases[name], cases[name].variants[variant]
            try:
                err = rel_err(call(0, config), refs[name])
                us = graph_us(lambda i, call=call, config=config: call(i, config), case.copies, replays=7)
            except Exception as error:  # out of shared memory or registers: not a candidate
                print(f"     skip M={rows} {name} {variant} {config}: {type(error).__name__}", flush=True)
                continue
            cfg = (f"{config.block_n}/{config.block_k}/w{config.num_warps}/s{config.num_stages}/k{config.split_k}"
                   + ("/tma" if config.tma else ""))
            log(dict(rows=rows, case=name, variant=variant, config=cfg, us=us, err=err, sweep=True))
            if err <= TOLERANCE:
                results.setdefault((rows, name, variant), []).append((us, cfg, case.weight_bytes / us / 1e6, config))
            else:
                print(f"FAIL M={rows} {name} {variant} {cfg}: rel err {err:.1e}", flush=True)
        for (found_rows, name, variant), found in results.items():
            if found_rows == rows:
                found.sort(key=lambda r: r[0])
                best = "  ".join(f"{cfg} {us:.1f}us {tbs:.2f}TB/s" for us, cfg, tbs, _ in found[:4])
                print(f"sweep M={rows:<2} {name:<8} ({variant}) {best}", flush=True)
    return {key: (found[0][0], found[0][3]) for key, found in results.items()}


def confirm(rows_list: list[int], best: dict, times: dict, device: torch.device, log: Callable[[dict], None]) -> bool:
    """Time the table again, each kernel on the sweep's best config where that beat the
    default at the sweep's row count (standing for every row count of its padding)."""
    from mstar.layers.triton_gemv import padded_rows

    chosen = {}
    for (rows, name, variant), (us, config) in sorted(best.items()):
        default = times.get((rows, name, variant))
        if default is None or us < default:
            chosen[padded_rows(rows), name, variant] = config
        print(f"chosen M={rows:<2} {name:<8} ({variant}) {chosen.get((padded_rows(rows), name, variant), 'default')}"
              f"  sweep {us:.1f} us, default {default if default is None else f'{default:.1f}'} us", flush=True)
    log(dict(chosen={f"{k[0]} {k[1]} {k[2]}": str(v) for k, v in chosen.items()}))
    return run([r for r in rows_list if r >= 3], device, False, log, chosen, label="confirm ")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--sweep", type=int, nargs="*", default=None, metavar="ROWS",
                        help="also time candidate launch configs at these row counts")
    parser.add_argument("--tma", action="store_true", help="sweep configs with weights through the copy engine")
    parser.add_argument("--confirm", action="store_true",
                        help="after the sweep, time the table again with each kernel's faster of the default and "
                             "the sweep's best (the sweep's row counts stand for their padding)")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the sweep's kernels")
    parser.add_argument("--json", default=None, help="append every timing to this file as JSON lines")
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
    out = open(args.json, "a") if args.json else None

    def log(record: dict) -> None:
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()

    rows = args.rows or ([1, 3, 20] if args.smoke else [1, 2, 4, 8, 16, 32, 64])
    if not args.smoke:
        precompile(default_jobs(rows) + (sweep_jobs(args.sweep, args.tma) if args.sweep else []), args.workers)
    ok, times = run(rows, device, args.smoke, log)
    if args.sweep and not args.smoke:
        best = sweep(args.sweep, log, args.tma)
        if args.confirm:
            ok &= confirm(rows, best, times, device, log)
    print("all ok" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
