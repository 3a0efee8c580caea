"""The Triton paged-attention backend against the PyTorch reference.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET``
is set here before ``mstar.layers.triton_attention`` (which applies ``triton.jit``) is first
imported. With CUDA the same comparisons run the compiled kernels. Skipped without Triton.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before triton's first import: its own jit'd helpers read it too
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from mstar.layers import triton_attention  # noqa: E402
from mstar.layers.attention import paged_attention, torch_paged_attention  # noqa: E402
from mstar.layers.paged_kv import PagedAttentionMetadata, write_kv_cache  # noqa: E402
from mstar.layers.triton_attention import triton_paged_attention  # noqa: E402
from tests.support.triton_interpreter import index_interpreted_scalars  # noqa: E402

if DEVICE.type == "cpu" and not (
    triton_attention.INTERPRET and type(triton.language.zeros).__name__ == "InterpretedFunction"
):
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)


if triton_attention.INTERPRET:
    index_interpreted_scalars()

# Max error relative to the reference's largest magnitude. The interpreter rounds fp32 to
# bf16 by truncation (up to one ulp, 2**-7); compiled kernels also round P to 16 bits.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_step(
    new_tokens: list[int],
    cached: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 4,
    num_pages: int = 96,
    extra_width: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Random q/k/v, a random cache (stale data everywhere) and the metadata of one step.

    Sequence ``b`` already holds ``cached[b]`` tokens and appends ``new_tokens[b]``; pages are
    taken from a shuffled free list; the page table is ``extra_width`` columns wider than needed.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_pages))
    rng.shuffle(free)
    positions, slots, starts, seq_lens, tables = [], [], [0], [], []
    for n_new, n_old in zip(new_tokens, cached):
        length = n_old + n_new
        pages = [free.pop() for _ in range(-(-length // page_size))]
        tables.append(pages)
        for p in range(n_old, length):
            positions.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        starts.append(starts[-1] + n_new)
        seq_lens.append(length)
    table = torch.zeros(len(tables), max(map(len, tables)) + extra_width, dtype=torch.int64)
    for row, pages in enumerate(tables):
        table[row, : len(pages)] = torch.tensor(pages)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    meta = PagedAttentionMetadata(ints(positions), ints(slots), ints(starts), ints(seq_lens),
                                  table.to(DEVICE), page_size)
    tokens = starts[-1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    q = rand(tokens, num_heads, head_dim)
    k, v = rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads, head_dim)
    cache = rand(2, num_pages, page_size, num_kv_heads, head_dim)
    return q, k, v, cache, meta


def check_against_reference(q, k, v, cache, meta, *, num_kv_splits: int | None = None,
                            merge_in_kernel: bool = False) -> None:
    scale = q.shape[-1] ** -0.5
    ref_cache = cache.float()
    ref = torch_paged_attention(q.float(), k.float(), v.float(), ref_cache, meta, scale)
    expected_cache = cache.clone()
    write_kv_cache(k, v, expected_cache, meta.slot_mapping)

    out = triton_paged_attention(q, k, v, cache, meta, scale, num_kv_splits=num_kv_splits,
                                 merge_in_kernel=merge_in_kernel)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(cache, expected_cache), "cache writes differ"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.2e} > {TOLERANCE[q.dtype]:.0e}"


# seq_lens 1, 4, 18, 41, 64 over shuffled 4-slot pages: several KV blocks per sequence
DECODE = ([1] * 5, [0, 3, 17, 40, 63])
PREFILL = ([5, 23, 40], [0, 0, 0])
MIXED = ([1, 17, 1, 6, 1], [30, 0, 9, 0, 2])
CHUNKED = ([9, 20, 1], [13, 35, 20])  # new tokens after cached ones, plus a decode
GQA = [(4, 4), (4, 2), (8, 2)]  # (query heads, KV heads): ratios 1, 2, 4


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3])
def test_decode(heads: tuple[int, int], head_dim: int, num_kv_splits: int | None) -> None:
    num_heads, num_kv_heads = heads
    step = make_step(*DECODE, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    check_against_reference(*step, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("case", [PREFILL, MIXED, CHUNKED], ids=["prefill", "mixed", "chunked"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_prefill_and_mixed(case: tuple[list[int], list[int]], heads: tuple[int, int], head_dim: int) -> None:
    num_heads, num_kv_heads = heads
    step = make_step(*case, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=1)
    check_against_reference(*step, num_kv_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [DECODE, MIXED, CHUNKED], ids=["decode", "mixed", "chunked"])
def test_half_precision(case: tuple[list[int], list[int]], dtype: torch.dtype) -> None:
    step = make_step(*case, num_heads=8, num_kv_heads=2, dtype=dtype, seed=2)
    check_against_reference(*step, num_kv_splits=3)


def test_decode_with_wide_page_table_and_large_pages() -> None:
    """As under a CUDA graph: the table is padded far beyond the longest sequence."""
    step = make_step([1] * 3, [0, 20, 47], page_size=16, num_pages=32, extra_width=6, seed=3)
    check_against_reference(*step)
    check_against_reference(*make_step([1] * 3, [0, 20, 47], page_size=16, num_pages=32,
                                       extra_width=6, seed=4), num_kv_splits=5)


def test_odd_head_dim_and_single_sequence() -> None:
    check_against_reference(*make_step([1], [33], head_dim=80, seed=5), num_kv_splits=2)
    check_against_reference(*make_step([21], [0], head_dim=80, seed=6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_splits_merged_in_the_decode_kernel(heads: tuple[int, int], dtype: torch.dtype) -> None:
    """``merge_in_kernel``: the last split of each (sequence, KV head) merges them, no combine
    kernel; decode-only and mixed steps (the decode rows through the sequence index), a
    padded table whose last splits are empty; the arrival counters are left at zero."""
    num_heads, num_kv_heads = heads
    launches = []
    combine = triton_attention._combine_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return combine[grid]

    triton_attention._combine_kernel = Counted()
    try:
        for case, splits, extra in ((DECODE, 3, 0), (DECODE, 9, 6), (MIXED, 4, 0)):
            step = make_step(*case, num_heads=num_heads, num_kv_heads=num_kv_heads, extra_width=extra, dtype=dtype,
                             seed=7)
            check_against_reference(*step, num_kv_splits=splits, merge_in_kernel=True)
    finally:
        triton_attention._combine_kernel = combine
    assert not launches
    assert not any(counters.any() for counters in triton_attention._counters.values())  # cuda:0, not cuda


def test_dispatch_through_paged_attention() -> None:
    q, k, v, cache, meta = make_step(*MIXED, seed=7)
    ref_cache = cache.clone()
    ref = paged_attention(q, k, v, ref_cache, meta, 0.125)
    out = paged_attention(q, k, v, cache, replace(meta, backend="triton"), 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache, ref_cache)
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(q, k, v, cache, replace(meta, backend="nope"), 0.125)


def _with_host_copies(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    return replace(meta, host_query_start_loc=tuple(meta.query_start_loc.tolist()),
                   host_seq_lens=tuple(meta.seq_lens.tolist()))


def test_a_mixed_step_splits_once_and_every_layer_reuses_it() -> None:
    """The host split of a mixed batch (decode rows, prefill tiles) is made by the first layer
    and reused by the others: the same tensors, the same results as a fresh split."""
    q, k, v, cache, meta = make_step(*MIXED)
    meta = _with_host_copies(meta)
    scale = q.shape[-1] ** -0.5
    first = triton_paged_attention(q, k, v, cache.clone(), meta, scale)
    made = dict(meta.step_tensors)
    assert {key if isinstance(key, str) else key[0] for key in made} == {"triton_decode_rows", "triton_prefill_tiles"}
    second = triton_paged_attention(q, k, v, cache.clone(), meta, scale)  # "the next layer"
    assert all(meta.step_tensors[key] is tensor for key, tensor in made.items())
    assert torch.equal(first, second)
    fresh = triton_paged_attention(q, k, v, cache.clone(), replace(meta), scale)  # a new step's own split
    assert torch.equal(first, fresh)
    check_against_reference(q, k, v, cache, meta)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host waits exist on CUDA only")
def test_a_mixed_step_with_host_copies_never_waits_for_the_device() -> None:
    """With the metadata's host copies (the engine always gives them), a mixed step's
    attention only queues work: a read-back in any layer would make the host wait for the
    device in every layer of a prefill step."""
    q, k, v, cache, meta = make_step(*MIXED)
    meta = _with_host_copies(meta)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # three layers
            triton_paged_attention(q, k, v, cache, meta, q.shape[-1] ** -0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
