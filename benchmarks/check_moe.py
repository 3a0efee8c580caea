"""The fused MoE kernels (``mstar.layers.triton_moe``) against ``fused_moe``'s torch paths, at
the Qwen3-Omni-30B-A3B thinker's expert shapes (hidden 2048, expert width 768, 128 experts,
top-8, bf16) for steps of 1 to 4096 tokens.

For each token count the router picks the experts from random logits (softmax, top-8,
renormalised, as the thinker's ``SparseMoE`` does), then three ways compute the experts:

* ``loop``: ``fused_moe``'s loop over the experts (one GEMM pair each; the reference path);
* ``grouped_mm``: ``fused_moe`` with ``torch._grouped_mm`` (n/a where torch lacks it);
* ``triton``: ``triton_fused_moe``, timed as launched and, replayed from a CUDA graph
  (``triton graph``), which also shows that it never waits on the host.

Each result is held against ``fused_moe`` in float32 on the same (bf16-rounded) inputs: the
largest absolute difference over the largest magnitude. ``triton`` over ``TOLERANCE`` is a
failure (exit status 1); the bf16 loop's own error is printed beside it. Times are CUDA
events, the median of ``--repeats`` calls after warm-up; ``TB/s`` is the weight bytes of the
experts the step touches over the triton time (the floor at decode, where the weights are
the traffic).

    python benchmarks/check_moe.py                      # on a GPU: T = 1 8 64 512 4096
    python benchmarks/check_moe.py --tokens 1 2 4 --json moe.jsonl
    python benchmarks/check_moe.py --smoke              # tiny shapes on the CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

FULL = dict(hidden=2048, inner=768, experts=128, top_k=8)  # the 30B-A3B thinker's MoE layers
TINY = dict(hidden=64, inner=32, experts=8, top_k=3)  # --smoke
TOLERANCE = 2e-2  # bf16: a few roundings of the output's largest magnitude


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the wall clock on the CPU)."""
    for _ in range(2 if device.type == "cuda" else 0):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream): its replay
    and the output tensor the replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def check(tokens: int, sizes: dict, device: torch.device, dtype: torch.dtype, repeats: int,
          log: Callable[[dict], None]) -> bool:
    from mstar.layers.moe import fused_moe, route_topk
    from mstar.layers.triton_moe import moe_config, triton_fused_moe

    hidden, inner, experts, top_k = sizes["hidden"], sizes["inner"], sizes["experts"], sizes["top_k"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    ids, weights = route_topk(logits, top_k, normalize=True)
    weights = weights.to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inner, hidden, device=device, generator=gen) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inner, device=device, generator=gen) / inner ** 0.5).to(dtype)
    want = fused_moe(x.float(), ids, weights.float(), w_gate_up.float(), w_down.float())

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "loop": lambda: fused_moe(x, ids, weights, w_gate_up, w_down),
        "grouped_mm": lambda: fused_moe(x, ids, weights, w_gate_up, w_down, grouped_mm=True),
        "triton": lambda: triton_fused_moe(x, ids, weights, w_gate_up, w_down),
    }
    errors, times = {}, {}
    for name, fn in ways.items():
        try:
            errors[name] = rel_err(fn(), want)
        except (RuntimeError, NotImplementedError) as err:  # grouped_mm: not on every torch / GPU
            print(f"  {name}: n/a ({str(err).splitlines()[0][:100]})", flush=True)
            continue
        times[name] = median_ms(fn, device, repeats)
    if device.type == "cuda":
        replay, out = graphed(ways["triton"])
        replay()
        errors["triton graph"] = rel_err(out, want)
        times["triton graph"] = median_ms(replay, device, repeats)
    touched = ids.unique().numel() * 3 * inner * hidden * w_down.element_size()
    tbs = touched / (times["triton"] * 1e-3) / 1e12
    ok = all(err <= (1e-5 if dtype == torch.float32 else TOLERANCE) for name, err in errors.items()
             if name.startswith("triton"))
    cfg = moe_config(tokens * top_k, experts, x.element_size())
    log(dict(tokens=tokens, **sizes, dtype=str(dtype), errors=errors, ms=times, touched_bytes=touched,
             triton_tbs=tbs, config=str(cfg), ok=ok))
    parts = "  ".join(f"{name} {times[name]:8.3f} ms (err {errors[name]:.1e})" for name in times)
    speedup = times["loop"] / min(times["triton"], times.get("triton graph", float("inf")))
    print(f"T={tokens:<5} {parts}  x{speedup:.1f} vs loop  {tbs:.2f} TB/s  block_m={cfg.block_m}"
          f"{'' if ok else '  FAIL'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="append every result to this file as JSON lines")
    args = parser.parse_args(argv)
    if args.smoke:  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, sizes = torch.device("cpu"), torch.float32, TINY
    elif torch.cuda.is_available():
        device, dtype, sizes = torch.device("cuda"), torch.bfloat16, FULL
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {sizes}", flush=True)
    else:
        print("needs a CUDA GPU (or --smoke)")
        return 1
    out = open(args.json, "a") if args.json else None

    def log(record: dict) -> None:
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()

    tokens = args.tokens or ([1, 5, 37] if args.smoke else [1, 8, 64, 512, 4096])
    repeats = 2 if args.smoke else args.repeats
    ok = True
    for t in tokens:
        ok &= check(t, sizes, device, dtype, repeats, log)
    print("all ok" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
