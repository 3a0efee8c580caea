"""Triton paged attention: the ``"triton"`` backend of ``mstar.layers.attention``.

Same contract as ``torch_paged_attention``: the new keys/values ``[T, Hkv, D]`` are written
into the paged cache ``[2, num_pages, page_size, Hkv, D]`` at ``meta.slot_mapping``, then each
new token attends causally to its sequence's cached tokens (``kv position <= its position``
and ``< seq_lens[b]``), reading K/V straight from the pages through ``meta.page_table``.

Two kernels do the attention:

* **decode** (sequences with one new token): one program per (sequence, KV head, KV split).
  All ``Hq / Hkv`` query heads sharing a KV head are handled together (their rows padded to
  16 for ``tl.dot``), so each K/V block is read once per group. Long contexts are split into
  ``num_splits`` contiguous KV ranges processed in parallel ("flash-decoding"); each split
  writes a normalised partial output and its log-sum-exp, and a small combine kernel merges
  them (or, with ``merge_in_kernel``, the last split of each group to finish does, as the
  GEMV kernels' split-K does: one launch where a step is bound by its kernel count).
  Online softmax in fp32 (base-2 exponentials), fp32/fp16/bf16 inputs.
* **prefill** (sequences with several new tokens, including chunked-prefill continuations):
  one program per (query block of ``BLOCK_M`` new tokens of one sequence, query head),
  looping over the sequence's KV blocks up to the block's last position with a causal mask.

Decode-only batches (``T == B``: every sequence has exactly one new token) take a path with
no host synchronisation and grid sizes computed from tensor shapes only (the KV split count
uses the page-table *width*, not the sequence lengths), so it can be captured in a CUDA
graph. Mixed or prefill batches read ``query_start_loc`` on the host to split the batch.
Precondition (as the engine guarantees): every sequence has at least one new token.

Triton is optional: this module imports without it (``HAS_TRITON`` is then False and calling
``triton_paged_attention`` raises). Kernels run on CUDA tensors, or on CPU tensors under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this module is imported.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata, to_device, write_kv_cache
from mstar.layers.triton_support import (
    HAS_TRITON,
    INTERPRET,
    launch_options,
    pdl,
    pdl_start,
    pdl_wait,
    tl,
    triton,
)

_LOG2E = 1.4426950408889634
# The split count is a runtime argument (not a compile-time constant), so a batch of a new
# size never waits for a kernel compile; the combine kernel reads up to this many partials.
_MAX_SPLITS = 32


if HAS_TRITON:

    @triton.jit
    def _decode_kernel(
        Q, K_CACHE, V_CACHE, OUT, PART_O, PART_LSE, COUNTERS,
        SEQ_INDEX, QUERY_START, POSITIONS, SEQ_LENS, PAGE_TABLE,
        qk_scale, tokens_per_split, num_splits,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_c_page, stride_c_slot, stride_c_head, stride_pt_seq,
        SPLIT: tl.constexpr, MERGE: tl.constexpr, USE_SEQ_INDEX: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        MAX_SPLITS: tl.constexpr, PDL: tl.constexpr,
    ):
        """One (decode item, KV head, KV split): the group's query heads over a KV range.
        With ``SPLIT`` and ``MERGE`` the last split of an (item, KV head) to finish merges
        all the splits' partials into ``OUT`` (``_merge_splits``) instead of a combine kernel."""
        pdl_start(PDL)
        pdl_wait(PDL)
        item = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if USE_SEQ_INDEX:
            seq = tl.load(SEQ_INDEX + item).to(tl.int64)
        else:
            seq = item.to(tl.int64)
        row = tl.load(QUERY_START + seq).to(tl.int64)
        kv_len = tl.minimum(tl.load(SEQ_LENS + seq), tl.load(POSITIONS + row) + 1).to(tl.int32)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, kv_len)

        offs_h = tl.arange(0, BLOCK_H)
        head_ok = offs_h < GROUP
        heads = kv_head * GROUP + offs_h
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            Q + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            page = tl.load(PAGE_TABLE + seq * stride_pt_seq + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            base = (page.to(tl.int64) * stride_c_page + (offs_n % PAGE_SIZE) * stride_c_slot
                    + kv_head * stride_c_head)
            k = tl.load(K_CACHE + base[:, None] + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_CACHE + base[:, None] + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if not SPLIT:
            out = acc / l_i[:, None]
            tl.store(OUT + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
                     out.to(OUT.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
        else:  # an empty split (beyond the sequence) writes weight zero: lse = -inf
            nonempty = l_i > 0
            safe_l = tl.where(nonempty, l_i, 1.0)
            lse = tl.where(nonempty, m_i + tl.log2(safe_l), float("-inf"))
            part = (item * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
            tl.store(PART_LSE + part, lse, mask=head_ok)
            tl.store(PART_O + part[:, None] * HEAD_DIM + offs_d[None, :], acc / safe_l[:, None],
                     mask=head_ok[:, None] & d_ok[None, :])
            if MERGE:
                _merge_splits(PART_O, PART_LSE, OUT, COUNTERS + item * tl.num_programs(1) + kv_head,
                              part - split, row, heads, head_ok, num_splits, stride_o_tok, stride_o_head,
                              BLOCK_H, HEAD_DIM, BLOCK_D, MAX_SPLITS)

    @triton.jit
    def _merge_splits(PART_O, PART_LSE, OUT, COUNTER, first, row, heads, head_ok, num_splits,
                      stride_o_tok, stride_o_head,
                      BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr):
        """``_combine_kernel``'s merge, run by the last of a group's ``num_splits`` programs to
        store its partials (``first``: the partial index of split 0 of each of the group's
        heads). Each program counts itself in on ``COUNTER`` after its stores (the barrier puts
        all of them before the acq_rel atomic); the last reads every split past L1 (not
        coherent with the other programs' stores), merges them in split order (so the result
        does not depend on which program finished last) and puts the counter back to zero for
        the next launch. The others' loads and stores are masked off."""
        tl.debug_barrier()
        last = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu") == num_splits - 1
        offs_s = tl.arange(0, MAX_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        mask = head_ok[:, None] & (offs_d[None, :] < HEAD_DIM) & last
        lse = tl.load(PART_LSE + first[:, None] + offs_s[None, :],
                      mask=head_ok[:, None] & (offs_s[None, :] < num_splits) & last, other=float("-inf"),
                      cache_modifier=".cg")
        top = tl.max(lse, 1)
        weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])  # [BLOCK_H, MAX_SPLITS]
        out = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in range(0, num_splits):
            w = tl.sum(tl.where(offs_s[None, :] == s, weight, 0.0), 1)
            o = tl.load(PART_O + (first + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg")
            out += w[:, None] * o
        total = tl.sum(weight, 1)
        out = out / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=mask)
        tl.store(COUNTER, 0, mask=last)

    @triton.jit
    def _combine_kernel(
        PART_O, PART_LSE, OUT, SEQ_INDEX, QUERY_START, stride_o_tok, stride_o_head, num_splits,
        BLOCK_S: tl.constexpr, USE_SEQ_INDEX: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        """Merge the KV splits of one (decode item, query head) by their log-sum-exps."""
        pdl_start(PDL)
        pdl_wait(PDL)
        item = tl.program_id(0)
        head = tl.program_id(1)
        if USE_SEQ_INDEX:
            seq = tl.load(SEQ_INDEX + item).to(tl.int64)
        else:
            seq = item.to(tl.int64)
        row = tl.load(QUERY_START + seq).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < num_splits
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        part = (item * tl.num_programs(1) + head) * num_splits + offs_s
        lse = tl.load(PART_LSE + part, mask=s_ok, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
        o = tl.load(PART_O + part[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
        tl.store(OUT + row * stride_o_tok + head * stride_o_head + offs_d,
                 out.to(OUT.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _prefill_kernel(
        Q, K_CACHE, V_CACHE, OUT,
        TILE_SEQ, TILE_START, QUERY_START, POSITIONS, SEQ_LENS, PAGE_TABLE,
        qk_scale,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_c_page, stride_c_slot, stride_c_head, stride_pt_seq,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One (query block of a sequence, query head): causal flash attention over pages."""
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(TILE_SEQ + tile).to(tl.int64)
        rows = (tl.load(QUERY_START + seq) + tl.load(TILE_START + tile) + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < tl.load(QUERY_START + seq + 1)
        pos = tl.load(POSITIONS + rows, mask=row_ok, other=0)
        kv_end = tl.minimum(tl.load(SEQ_LENS + seq), tl.max(pos, 0) + 1).to(tl.int32)

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            page = tl.load(PAGE_TABLE + seq * stride_pt_seq + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            base = (page.to(tl.int64) * stride_c_page + (offs_n % PAGE_SIZE) * stride_c_slot
                    + kv_head * stride_c_head)
            k = tl.load(K_CACHE + base[:, None] + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            causal = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_CACHE + base[:, None] + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class _Tiling:
    """Block sizes and launch options of the kernels for one device kind and head size."""

    decode_block_n: int
    prefill_block_m: int
    prefill_block_n: int
    min_tokens_per_split: int  # below this many KV tokens a split is not worth a program
    num_warps: int
    num_stages: int


def _tiling(device: torch.device, head_dim: int) -> _Tiling:
    if device.type != "cuda":  # the interpreter: small blocks so tests cross block borders
        return _Tiling(16, 16, 16, 32, 1, 1)
    # Picked on an H200 (bf16, head_dim 128): 3 pipeline stages beat 2 by 10-25% in
    # prefill and slightly in decode; larger blocks or 8 warps did not help. A split may be
    # as short as one KV block: at one sequence a few hundred tokens long, a decode step is
    # latency-bound and more, shorter splits finish sooner (see check_gpu_attention's sweep).
    if head_dim <= 128:
        return _Tiling(64, 64, 64, 64, 4, 3)
    return _Tiling(32, 64, 32, 64, 4, 2)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _split_plan(
    device: torch.device, num_items: int, num_kv_heads: int, max_kv_len: int, tiling: _Tiling,
    num_splits: int | None,
) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` from shapes only (CUDA-graph safe).

    Enough splits to give about two programs per SM, none shorter than
    ``min_tokens_per_split``, at most ``_MAX_SPLITS``; each split a multiple of the KV block.
    """
    if num_splits is None:
        wanted = math.ceil(2 * _num_sms(device) / max(1, num_items * num_kv_heads))
        worth = math.ceil(max_kv_len / tiling.min_tokens_per_split)
        num_splits = min(wanted, worth, _MAX_SPLITS)
    num_splits = max(1, min(num_splits, _MAX_SPLITS))
    block = tiling.decode_block_n
    per_split = math.ceil(math.ceil(max_kv_len / num_splits) / block) * block
    return max(1, math.ceil(max_kv_len / per_split)), per_split


_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, groups: int) -> torch.Tensor:
    """The arrival counters (int32 zeros) of ``groups`` (decode item, KV head) groups on
    ``device``: one buffer per device, left zeroed by the kernels (the last program of a group
    resets its counter), shared by every launch. Launches on one stream run one at a time;
    kernels on two streams at once must not both merge in the kernel. It grows only outside a
    CUDA-graph capture (a capture would record the zero fill instead of running it): a
    captured step must have run once before, as the graph runners' warm-ups do."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < groups:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode attention's merge counters must be allocated before a CUDA-graph "
                               "capture: run the step once eagerly first")
        buf = _counters[device] = torch.zeros(max(groups, 1 << 14), dtype=torch.int32, device=device)
    return buf


def _launch_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, out: torch.Tensor,
    qk_scale: float, num_items: int, seq_index: torch.Tensor | None, num_splits: int | None,
    merge_in_kernel: bool = False,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    tiling = _tiling(q.device, head_dim)
    max_kv_len = meta.page_table.shape[1] * meta.page_size
    splits, per_split = _split_plan(q.device, num_items, num_kv_heads, max_kv_len, tiling, num_splits)
    merge = merge_in_kernel and splits > 1
    if splits > 1:
        part_o = torch.empty(num_items, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_items, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    counters = _merge_counters(q.device, num_items * num_kv_heads) if merge else out  # else unused
    use_index = seq_index is not None
    index = seq_index if seq_index is not None else meta.seq_lens  # unused placeholder
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = max(16, _next_pow2(head_dim))
    on = pdl(q)
    _decode_kernel[(num_items, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_o, part_lse, counters,
        index, meta.query_start_loc, meta.positions, meta.seq_lens, meta.page_table,
        qk_scale, per_split, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.page_table.stride(0),
        SPLIT=splits > 1, MERGE=merge, USE_SEQ_INDEX=use_index,
        GROUP=group, BLOCK_H=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=meta.page_size, BLOCK_N=tiling.decode_block_n,
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype), MAX_SPLITS=_MAX_SPLITS, PDL=on,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, **launch_options(on),
    )
    if splits > 1 and not merge:
        _combine_kernel[(num_items, num_heads)](
            part_o, part_lse, out, index, meta.query_start_loc, out.stride(0), out.stride(1), splits,
            BLOCK_S=_MAX_SPLITS, USE_SEQ_INDEX=use_index,
            HEAD_DIM=head_dim, BLOCK_D=block_d, PDL=on, num_warps=tiling.num_warps, **launch_options(on),
        )


def _launch_prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, out: torch.Tensor,
    qk_scale: float, seqs: list[int], counts: list[int],
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    tiling = _tiling(q.device, head_dim)
    block_m = tiling.prefill_block_m
    key = ("triton_prefill_tiles", block_m)
    tiles = meta.step_tensors.get(key)
    if tiles is None:
        host = [(b, m0) for b in seqs for m0 in range(0, counts[b], block_m)]
        tiles = meta.step_tensors[key] = to_device(torch.tensor(host, dtype=torch.int32).t().contiguous(), q.device)
    tile_seq, tile_start = tiles
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[(tiles.shape[1], num_heads)](
        q, k_cache, v_cache, out,
        tile_seq, tile_start, meta.query_start_loc, meta.positions, meta.seq_lens, meta.page_table,
        qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.page_table.stride(0),
        GROUP=num_heads // kv_cache.shape[3], HEAD_DIM=head_dim,
        BLOCK_D=max(16, _next_pow2(head_dim)), PAGE_SIZE=meta.page_size,
        BLOCK_M=block_m, BLOCK_N=tiling.prefill_block_n,
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )


def _dot_dtype(dtype: torch.dtype) -> object:
    """Operand type of the kernels' ``tl.dot``: the input dtype (fp32 accumulation).

    Triton's interpreter mis-computes bf16 ``tl.dot`` (NumPy has no bfloat16), so there the
    bf16 operands are widened to fp32; compiled kernels multiply bf16 on tensor cores.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRET else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 operands (no TF32); ignored for 16-bit operands."""
    return "ieee" if _dot_dtype(dtype) == tl.float32 else "tf32"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           meta: PagedAttentionMetadata) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the 'triton' attention backend needs the triton package")
    if not q.is_cuda and not INTERPRET:
        raise RuntimeError("Triton attention needs CUDA tensors (or TRITON_INTERPRET=1 set "
                           "before mstar.layers.triton_attention is imported)")
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"bad q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(f"KV cache of shape {tuple(kv_cache.shape)} does not fit keys {tuple(k.shape)}")
    if kv_cache.shape[2] != meta.page_size:
        raise ValueError(f"cache page size {kv_cache.shape[2]} != metadata page size {meta.page_size}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if kv_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    if meta.strided is not None:  # the kernels index it by element: a strided view would be misread
        raise ValueError(f"the metadata's {meta.strided} must be contiguous "
                         f"(got strides {getattr(meta, meta.strided).stride()})")


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    write_kv: bool = True,
    merge_in_kernel: bool = False,
) -> torch.Tensor:
    """Paged attention with Triton kernels; the contract of ``torch_paged_attention``.

    ``q`` is ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``; the metadata tensors must be on
    ``q``'s device. Returns ``[T, Hq, D]`` in ``q``'s dtype. ``num_kv_splits`` forces the
    number of KV splits of the decode kernel (default: chosen from the shapes);
    ``merge_in_kernel`` has the decode kernel merge them itself (its last split to finish
    per KV head), one launch instead of two (see ``_merge_counters`` for its one-stream
    rule). A decode-only batch (``T == B``) runs without host synchronisation (CUDA-graph
    safe).
    """
    _check(q, k, v, kv_cache, meta)
    if write_kv:  # else the caller wrote them (e.g. the fused RoPE kernel)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_seqs = q.shape[0], meta.seq_lens.shape[0]
    if num_tokens == 0:
        return out
    qk_scale = scale * _LOG2E
    if num_tokens == num_seqs:  # decode only: one new token per sequence, no host sync
        _launch_decode(q, kv_cache, meta, out, qk_scale, num_seqs, None, num_kv_splits, merge_in_kernel)
        return out

    # A mixed batch is split on the host, once per step: the metadata's host copies, and the
    # index tensors made by the first layer and reused by the others (never a wait on the device).
    starts = meta.query_starts
    counts = [end - start for start, end in zip(starts, starts[1:])]
    decode = [b for b, n in enumerate(counts) if n == 1]
    prefill = [b for b, n in enumerate(counts) if n > 1]
    if decode:
        seq_index = meta.step_tensors.get("triton_decode_rows")
        if seq_index is None:
            seq_index = meta.step_tensors["triton_decode_rows"] = to_device(
                torch.tensor(decode, dtype=torch.int32), q.device)
        _launch_decode(q, kv_cache, meta, out, qk_scale, len(decode), seq_index, num_kv_splits, merge_in_kernel)
    if prefill:
        _launch_prefill(q, kv_cache, meta, out, qk_scale, prefill, counts)
    return out
