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
    python benchmarks/check_moe.py --sweep              # then ~25 launch configs per token count (graphs)
    python benchmarks/check_moe.py --smoke              # tiny shapes on the CPU, Triton's interpreter
    python benchmarks/check_moe.py --compile            # no GPU needed: build every kernel for sm_90

``--compile`` builds (Triton to PTX, then the wheel's ptxas) every kernel the token counts would
launch, bf16 and fp32, for an H100/H200 (``--arch``), with the launch's specialisations
(16-byte aligned pointers and strides, the unit stride a constant), and prints each kernel's
shared memory, its MMA instructions and whether its K loop is software-pipelined (``cp.async``
in the PTX); a compile error or more shared memory than a Hopper block may take fails.
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


def problem(tokens: int, sizes: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(x, ids, weights, w_gate_up, w_down)`` of one step: routed by random logits as the
    thinker's ``SparseMoE`` routes (softmax, top-k, renormalised)."""
    from mstar.layers.moe import route_topk

    hidden, inner, experts, top_k = sizes["hidden"], sizes["inner"], sizes["experts"], sizes["top_k"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    ids, weights = route_topk(logits, top_k, normalize=True)
    w_gate_up = (torch.randn(experts, 2 * inner, hidden, device=device, generator=gen) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inner, device=device, generator=gen) / inner ** 0.5).to(dtype)
    return x, ids, weights.to(dtype), w_gate_up, w_down


def check(tokens: int, sizes: dict, device: torch.device, dtype: torch.dtype, repeats: int,
          log: Callable[[dict], None]) -> bool:
    from mstar.layers.moe import fused_moe
    from mstar.layers.triton_moe import moe_config, triton_fused_moe

    inner, hidden, experts, top_k = sizes["inner"], sizes["hidden"], sizes["experts"], sizes["top_k"]
    x, ids, weights, w_gate_up, w_down = problem(tokens, sizes, device, dtype)
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
        try:
            replay, out = graphed(ways["triton"])
        except RuntimeError as err:  # a host sync inside the call breaks the capture
            print(f"  triton graph: FAIL ({str(err).splitlines()[0][:160]})", flush=True)
            errors["triton graph"] = float("inf")
        else:
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


def sweep(tokens: int, sizes: dict, device: torch.device, dtype: torch.dtype, repeats: int,
          log: Callable[[dict], None]) -> None:
    """Time ``triton_fused_moe`` under launch configs around ``moe_config``'s choice (rows per
    block halved and doubled; column blocks; K step), each replayed from a CUDA graph, and
    print the fastest beside the default: what ``_TABLE`` in ``mstar/layers/triton_moe.py``
    should say for this step size."""
    from mstar.layers.moe import fused_moe
    from mstar.layers.triton_moe import MoEConfig, moe_config, triton_fused_moe

    x, ids, weights, w_gate_up, w_down = problem(tokens, sizes, device, dtype)
    want = fused_moe(x.float(), ids, weights.float(), w_gate_up.float(), w_down.float())
    default = moe_config(tokens * sizes["top_k"], sizes["experts"], x.element_size())
    candidates = [default]
    for block_m in sorted({max(16, default.block_m // 2), default.block_m, min(128, default.block_m * 2)}):
        for block_n, block_n_down in ((32, 64), (64, 64), (64, 128), (128, 128)):
            for block_k in (64, 128):
                cfg = MoEConfig(block_m, block_n, block_n_down, block_k, 4 if block_m <= 64 else 8,
                                4 if block_m <= 32 else 3)
                if cfg not in candidates:
                    candidates.append(cfg)
    results = []
    for cfg in candidates:
        try:
            replay, out = graphed(lambda cfg=cfg: triton_fused_moe(x, ids, weights, w_gate_up, w_down, config=cfg))
            replay()
            err = rel_err(out, want)
            ms = median_ms(replay, device, repeats)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: the config is skipped
            print(f"  T={tokens} {cfg}: {type(exc).__name__}", flush=True)
            continue
        if err > TOLERANCE:
            print(f"  T={tokens} {cfg}: wrong (err {err:.1e})", flush=True)
            continue
        results.append((ms, cfg))
        log(dict(sweep=True, tokens=tokens, config=str(cfg), ms=ms, err=err, default=cfg == default))
    results.sort(key=lambda r: r[0])
    default_ms = next(ms for ms, cfg in results if cfg == default) if any(c == default for _, c in results) else None
    for ms, cfg in results[:3]:
        print(f"T={tokens:<5} {ms:8.3f} ms  {cfg}", flush=True)
    print(f"T={tokens:<5} default {default_ms if default_ms is None else f'{default_ms:.3f}'} ms  {default}",
          flush=True)


SMEM_LIMIT = 227 << 10  # shared memory one Hopper block may take


def compile_kernels(tokens_list: list[int], sizes: dict, arch: int) -> bool:
    """Build every kernel that ``tokens_list`` launches at ``sizes`` for CUDA ``arch`` (no GPU
    needed) and report each; False if one fails to build or takes too much shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar.layers import triton_moe as moe

    hidden, inner, experts, top_k = sizes["hidden"], sizes["inner"], sizes["experts"], sizes["top_k"]
    target, built, ok = GPUTarget("cuda", arch, 32), set(), True
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def build(fn, constants: dict, dtype: torch.dtype, label: str) -> None:
        nonlocal ok
        constants = dict(constants, stride_wk=1) if "stride_wk" in fn.arg_names else dict(constants)
        options = {key: constants.pop(key) for key in ("num_warps", "num_stages") if key in constants}
        key = (fn.__name__, str(sorted(constants.items())), str(options))
        if key in built:
            return
        built.add(key)
        signature = {}
        for name in fn.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name == "IDS":
                signature[name] = "*i64"
            elif name in ("SORTED", "BLOCK_EXPERT", "OFFSETS"):
                signature[name] = "*i32"
            elif name.isupper():
                signature[name] = "*" + names[dtype]
            else:
                signature[name] = "i32"
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
                   if t.startswith("*") or n.startswith("stride")}
        start = time.perf_counter()
        try:
            kernel = triton.compile(ASTSource(fn, signature, constants, aligned), target=target, options=options)
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the run fails
            ok = False
            print(f"{label:<28} {fn.__name__:<20} FAIL {type(err).__name__}: {str(err).splitlines()[-1][:200]}")
            return
        ptx, shared = kernel.asm["ptx"], kernel.metadata.shared
        mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no mma"
        pipelined = "pipelined" if "cp.async" in ptx else "not pipelined"
        good = shared <= SMEM_LIMIT
        ok &= good
        print(f"{label:<28} {fn.__name__:<20} {shared >> 10:4d} KB shared  {mma:<8} {pipelined:<13} "
              f"{time.perf_counter() - start:5.1f} s{'' if good else '  FAIL: too much shared memory'}", flush=True)

    for dtype in (torch.bfloat16, torch.float32):
        for tokens in tokens_list:
            pairs = tokens * top_k
            cfg = moe.moe_config(pairs, experts, torch.empty((), dtype=dtype).element_size())
            label = f"T={tokens} {names[dtype]} block_m={cfg.block_m}"
            if pairs <= moe.SORT_KERNEL_MAX_PAIRS:
                build(moe._sort_pairs_kernel, moe.sort_constants(pairs, experts, cfg.block_m), dtype, label)
            gate_up, down = moe.kernel_constants(cfg, dtype, hidden, inner, top_k)
            build(moe._gate_up_kernel, gate_up, dtype, label)
            build(moe._down_kernel, down, dtype, label)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="append every result to this file as JSON lines")
    parser.add_argument("--sweep", action="store_true", help="after the check, time launch configs around "
                        "the default at each token count (GPU)")
    parser.add_argument("--compile", action="store_true", help="only build the kernels for --arch (no GPU needed)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile (90: Hopper)")
    args = parser.parse_args(argv)
    if args.compile:  # the kernels compiled, not interpreted: before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "0"
        ok = compile_kernels(args.tokens or [1, 8, 64, 512, 4096], FULL, args.arch)
        print("all ok" if ok else "FAILURES", flush=True)
        return 0 if ok else 1
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
    if args.sweep and device.type == "cuda":
        for t in tokens:
            sweep(t, sizes, device, dtype, repeats, log)
    print("all ok" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
