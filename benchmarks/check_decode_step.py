"""A whole Llama-3.1-8B decode step (bf16, 32 layers, random weights, ``fused_kernels`` on,
Triton attention), captured in a CUDA graph, under rules for the decoder's projections
(``mstar.model.llama.modeling.DECODE_GEMV``), at several row counts. ``--rules`` names them
(the first is the base the others are compared with): ``before`` (every projection on our
Triton kernels, norm as their prologue, up to two rows; cuBLAS above: the rule before issue
17), ``tuned`` (the rule in the code), ``no_prologue`` (``tuned`` with the norm a kernel of
its own at every row count) and ``cublas`` (cuBLAS and the separate fused kernels always).

Each sequence has ``--context`` tokens cached (random keys and values) and decodes one; the
step ends with the logits. Printed per row count: milliseconds per replayed step under each
rule (median of ``--replays``), the saving, and the logits' difference between the two rules
(max error relative to the largest logit: the same function, so bf16 rounding only).
On an H200, in about half a minute:

    python benchmarks/check_decode_step.py --rows 4 8 16 32 64

Measured there on 2026-12-03 (context 128, the rule of ``DECODE_GEMV`` then: o up to 16 rows,
gate_up up to 64), ms per step, ``before`` -> ``tuned``: 4 rows 4.653 -> 4.473 (-3.9%), 8 rows
4.732 -> 4.544 (-4.0%), 16 rows 4.844 -> 4.626 (-4.5%), 32 rows 5.070 -> 5.014 (-1.1%), 64
rows 5.175 -> 5.026 (-2.9%). (That run drew different token ids per rule, so its logits
column compared different inputs; the ids are now seeded by the row count. The timings do
not depend on the ids.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch

CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
              rope_theta=500000.0)
PAGE_SIZE = 16


def build(device: torch.device):
    from mstar.model.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
    model = model.to(torch.bfloat16).eval()
    model.use_fused_kernels()
    return model


def step_inputs(rows: int, context: int, device: torch.device):
    """Ids and decode metadata for ``rows`` sequences of ``context`` tokens (the last new),
    each on pages of its own."""
    from mstar.layers.paged_kv import PagedAttentionMetadata

    pages = -(-context // PAGE_SIZE)
    table = torch.arange(rows * pages, device=device).view(rows, pages)
    pos = context - 1
    meta = PagedAttentionMetadata(
        positions=torch.full((rows,), pos, device=device),
        slot_mapping=table[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE,
        query_start_loc=torch.arange(rows + 1, device=device),
        seq_lens=torch.full((rows,), context, device=device),
        page_table=table, page_size=PAGE_SIZE, backend="triton")
    gen = torch.Generator(device=device).manual_seed(rows)  # the same tokens under every rule
    ids = torch.randint(0, CONFIG["vocab_size"], (rows,), device=device, generator=gen)
    return ids, meta, rows * pages


def set_launch(pdl: str) -> None:
    """``off``: plain launches; ``N`` or ``late:N``: PDL launches, the GEMVs fetching N MB of
    weights into L2 before they wait and letting the next kernel start at their start (or,
    ``late:``, after their main loop; ``mstar.layers.triton_support``)."""
    from mstar.layers.triton_support import set_pdl

    if pdl == "off":
        set_pdl(False)
    else:
        late, _, mb = pdl.rpartition(":")
        set_pdl(True, int(float(mb) * (1 << 20)), late_trigger=late == "late")


def profile_graph(graph: torch.cuda.CUDAGraph, replays: int) -> str:
    """Kernels of ``replays`` graph replays by the torch profiler: per step, the kernels' summed
    time against the step's wall time, and the ten costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
    wall = start.elapsed_time(end) / replays
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1000)
    total = sum(sum(v) for v in kernels.values()) / replays
    count = sum(len(v) for v in kernels.values()) / replays
    lines = [f"    profile: {count:.0f} kernels a step, {total:.3f} ms of kernel time a step, wall {wall:.3f} ms "
             f"(gaps/overlap {wall - total:+.3f} ms)"]
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:10]:
        lines.append(f"    {sum(times) / replays:8.3f} ms  {len(times) / replays:5.0f}x  "
                     f"{1000 * statistics.median(times):7.1f} us  {name[:90]}")
    return "\n".join(lines)


def time_rule(model, rule, rows: int, context: int, caches, replays: int, pdl: str = "off",
              profile: bool = False, prefetch: str = "off") -> tuple[float, torch.Tensor]:
    """Median ms of a replayed step under ``rule``, ``pdl`` (``set_launch``) and the L2
    ``prefetch`` plan (``PrefetchPlan.parse``), and its logits."""
    from mstar.layers.triton_prefetch import PrefetchPlan
    from mstar.model.llama import modeling

    modeling.DECODE_GEMV = rule
    modeling.L2_PREFETCH = PrefetchPlan.parse(prefetch)
    set_launch(pdl)
    ids, meta, _ = step_inputs(rows, context, caches[0].device)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and pick kernels outside the capture
            for _ in range(2):
                model.compute_logits(model(ids, meta, caches))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.compute_logits(model(ids, meta, caches))
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out = logits.clone()
        if profile:
            print(f"  rows {rows}, pdl {pdl}, prefetch {prefetch}:\n" + profile_graph(graph, 5), flush=True)
    del graph
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence, the new one included")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--rules", nargs="+", default=["before", "tuned"],
                        choices=["before", "tuned", "no_prologue", "cublas"])
    parser.add_argument("--pdl", nargs="+", default=["off"],
                        help="launch settings, each tried with every rule: off (plain launches) or MB of "
                             "weights a GEMV prefetches under programmatic dependent launch (0: PDL, no prefetch)")
    parser.add_argument("--prefetch", nargs="+", default=["off"],
                        help="L2 prefetch plans, each tried with every rule and launch setting: off, or "
                             "e.g. o=1,gate_up=0.25,qkv=0.25,max_rows=64 (mstar.layers.triton_prefetch)")
    parser.add_argument("--profile-rows", type=int, nargs="*", default=[],
                        help="row counts at which to print a kernel profile of each variant's step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from mstar.layers.paged_kv import allocate_kv_cache
    from mstar.layers.triton_prefetch import PrefetchPlan
    from mstar.model.llama import modeling
    from mstar.model.llama.modeling import GemvRule

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    model = build(device)
    _, _, pages = step_inputs(max(args.rows), args.context, device)
    caches = allocate_kv_cache(CONFIG["num_hidden_layers"], pages + 1, PAGE_SIZE, CONFIG["num_key_value_heads"],
                               CONFIG["head_dim"], torch.bfloat16, device)
    for cache in caches:
        cache.normal_()
    tuned = modeling.DECODE_GEMV
    known = {"before": GemvRule(qkv=2, o=2, gate_up=2, down=2, norm_prologue=2), "tuned": tuned,
             "no_prologue": replace(tuned, norm_prologue=0), "cublas": GemvRule(0, 0, 0, 0, 0)}
    rules = {name: known[name] for name in args.rules}
    print("rules: " + "; ".join(f"{name} {rule}" for name, rule in rules.items()), flush=True)
    variants = {"/".join([name] + ([f"pdl-{pdl}"] if len(args.pdl) > 1 else [])
                         + ([f"prefetch-{plan}"] if len(args.prefetch) > 1 else [])): (rule, pdl, plan)
                for name, rule in rules.items() for pdl in args.pdl for plan in args.prefetch}
    try:
        for rows in args.rows:
            results = {name: time_rule(model, rule, rows, args.context, caches, args.replays, pdl,
                                       rows in args.profile_rows, plan)
                       for name, (rule, pdl, plan) in variants.items()}
            (base_name, (base, base_logits)), *others = results.items()
            line = f"rows {rows:2}: {base_name} {base:.3f} ms"
            for name, (ms, logits) in others:
                diff = ((logits.float() - base_logits.float()).abs().max() / base_logits.float().abs().max()).item()
                line += (f"  {name} {ms:.3f} ms ({100 * (ms - base) / base:+.1f}%, logits rel diff {diff:.1e})")
            print(line, flush=True)
    finally:
        modeling.DECODE_GEMV = tuned
        modeling.L2_PREFETCH = PrefetchPlan()
        set_launch("off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
