"""GPU self-check of the Triton paged attention against the PyTorch reference.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, page size 16,
pages shuffled over the pool. For each case: max abs / relative error against the reference,
and the median time of 20 calls (after warm-up, CUDA events) of both backends, each call
including the cache write. Decode cases are also replayed from a CUDA graph (checking that
the decode path is capturable). Runs in well under a minute on an H200:

    python benchmarks/check_gpu_attention.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from mstar.layers.attention import torch_paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
TOLERANCE = 2e-2  # max error relative to the reference's largest magnitude


def make_case(new_tokens: list[int], cached: list[int], device: torch.device, seed: int = 0):
    """Random q/k/v/cache and the metadata of one step over shuffled pages."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths = [n + c for n, c in zip(new_tokens, cached)]
    pages_per_seq = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_per_seq) + 1
    perm = torch.randperm(num_pages, generator=gen)
    width = max(pages_per_seq)
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    positions, slots, used = [], [], 0
    for b, (n_new, n_old, n_pages) in enumerate(zip(new_tokens, cached, pages_per_seq)):
        table[b, :n_pages] = perm[used: used + n_pages]
        used += n_pages
        pos = torch.arange(n_old, n_old + n_new)
        positions.append(pos)
        slots.append(table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
    starts = torch.tensor([0] + new_tokens).cumsum(0)
    meta = PagedAttentionMetadata(
        positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc=starts.to(device), seq_lens=torch.tensor(lengths).to(device),
        page_table=table.to(device), page_size=PAGE_SIZE)
    tokens = sum(new_tokens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=DTYPE)

    q = rand(tokens, NUM_HEADS, HEAD_DIM)
    k, v = rand(tokens, NUM_KV_HEADS, HEAD_DIM), rand(tokens, NUM_KV_HEADS, HEAD_DIM)
    cache = rand(2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return q, k, v, cache, meta


def median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(name: str, new_tokens: list[int], cached: list[int], device: torch.device) -> bool:
    from mstar.layers.triton_attention import triton_paged_attention

    q, k, v, cache, meta = make_case(new_tokens, cached, device)
    ref_cache = cache.clone()
    ref = torch_paged_attention(q, k, v, ref_cache, meta, SCALE)
    out = triton_paged_attention(q, k, v, cache, meta, SCALE)
    err = (out.float() - ref.float()).abs().max().item()
    rel = err / ref.float().abs().max().item()
    ok = rel <= TOLERANCE and torch.equal(cache, ref_cache)

    t_ref = median_ms(lambda: torch_paged_attention(q, k, v, ref_cache, meta, SCALE))
    t_tri = median_ms(lambda: triton_paged_attention(q, k, v, cache, meta, SCALE))
    kv_bytes = int(meta.seq_lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * cache.element_size()
    line = (f"{name:<34} max|err| {err:.2e} rel {rel:.2e} | torch {t_ref:8.3f} ms  "
            f"triton {t_tri:7.3f} ms  x{t_ref / t_tri:6.1f}  KV read {kv_bytes / t_tri / 1e6:7.0f} GB/s")

    if len(new_tokens) == q.shape[0]:  # decode only: must replay from a CUDA graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = triton_paged_attention(q, k, v, cache, meta, SCALE)
        graph.replay()
        torch.cuda.synchronize()
        graph_ok = torch.equal(graphed, out)
        t_graph = median_ms(graph.replay)
        line += f" | graph {t_graph:7.3f} ms {'ok' if graph_ok else 'MISMATCH'}"
        ok = ok and graph_ok
    print(("ok   " if ok else "FAIL ") + line, flush=True)
    return ok


def split_sweep(batch: int, context: int, device: torch.device) -> None:
    """CUDA-graph replay time of a decode step at several forced KV split counts, beside
    the split count the kernel picks itself (``auto``)."""
    from mstar.layers.triton_attention import triton_paged_attention

    q, k, v, cache, meta = make_case([1] * batch, [context - 1] * batch, device)
    times = []
    for splits in (None, 1, 2, 4, 8, 16):
        graph = torch.cuda.CUDAGraph()
        triton_paged_attention(q, k, v, cache, meta, SCALE, num_kv_splits=splits)  # compile first
        with torch.cuda.graph(graph):
            triton_paged_attention(q, k, v, cache, meta, SCALE, num_kv_splits=splits)
        times.append(f"{splits or 'auto'}: {median_ms(graph.replay) * 1e3:.1f} us")
    print(f"     splits B={batch} ctx={context}: " + ", ".join(times), flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    ok = True
    for batch in (1, 16, 64):
        for context in (256, 1024, 4096):
            # lengths spread over [context / 2, context]
            lens = torch.randint(context // 2, context + 1, (batch,), generator=gen).tolist()
            ok &= check(f"decode B={batch:<3} ctx<={context}", [1] * batch, [n - 1 for n in lens], device)
    for batch, context in ((1, 256), (1, 1500), (16, 256)):  # KV splits at short contexts, replayed
        split_sweep(batch, context, device)
    ok &= check("prefill B=1 new=2048", [2048], [0], device)
    ok &= check("chunked B=4 new=512 cached=1024", [512] * 4, [1024] * 4, device)
    ok &= check("mixed 16 decodes ctx 2048 + 2x256", [1] * 16 + [256, 256], [2047] * 16 + [0, 512], device)
    print(f"{'all ok' if ok else 'FAILURES'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
