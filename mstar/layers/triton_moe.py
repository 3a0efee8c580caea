"""The sparse MoE experts (``mstar.layers.moe.fused_moe``) as two grouped-GEMM Triton kernels.

``triton_fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down)`` computes what ``fused_moe``
does, ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, in four steps:

1. **Sort**: the ``P = T * k`` token-expert pairs (pair ``p = t * k + slot``) are grouped by
   expert, stably, and each expert's run is padded to a whole number of ``BLOCK_M`` rows.
   ``sorted_pairs`` holds, per padded row, its pair (``P`` on padding) and ``block_expert``,
   per block of ``BLOCK_M`` rows, its expert (``E`` for the blocks past the last: their
   programs return at once). The padded length is not read back to the host: the buffers
   take the upper bound ``P + min(E, P) * (BLOCK_M - 1)``, so the step never waits for the
   GPU and can be captured in a CUDA graph. Up to ``SORT_KERNEL_MAX_PAIRS`` pairs (decode and
   short prefills) one single-program kernel does it (``_sort_pairs_kernel``: a bitonic sort
   of ``expert * P_BLOCK + pair`` keys, a histogram, two scans); above, ``sort_pairs`` in torch
   (some twenty small launches, negligible beside the GEMMs there). Both give the same layout.
2. **gate_up** (``_gate_up_kernel``): a program owns one block of sorted rows (one expert) and
   ``BLOCK_N`` of that expert's ``I`` features. It gathers its tokens' rows of ``x`` by index,
   multiplies them with the expert's gate rows and its up rows (two accumulators over the same
   ``x`` tile), and stores ``silu(gate) * up`` in the inputs' dtype: the ``[pairs, 2I]``
   projection is never written, only the ``[padded rows, I]`` activation.
3. **down** (``_down_kernel``): the same grid over ``H`` output columns; the routing weight of
   each pair scales its row in the epilogue, and the row is stored at the pair's place in
   token order, ``[T * k, H]``.
4. **Sum**: ``[T, k, H]`` summed over ``k`` (fp32 inside torch's sum), so no atomics and the
   result does not depend on timing. A token sent to one expert twice has two pairs, so two
   rows: it counts twice, as in the reference.

Both kernels accumulate in fp32 (fp32 operands as exact fp32 products, no TF32); inputs are
bf16, fp16 or fp32 (all the same dtype), the output is ``x``'s dtype. Rounding differs from the
reference only where the reference rounds intermediate results to the dtype (the projections,
the activation, each weighted row): equal to float32 precision in fp32, within bf16's in bf16.

Block sizes come from ``moe_config``: a small table keyed on the average rows per expert
``T * k / E`` (decode: one or a few pairs per expert, so 16-row blocks that waste little on
padding; prefill: 64 or 128 rows, so each weight tile is read once for many tokens). The
entries are starting points, not yet swept on a GPU (``benchmarks/check_moe.py`` times them).
Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (see
``mstar.layers.triton_support``); without Triton the module imports and the wrapper raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from mstar.layers.triton_support import HAS_TRITON, INTERPRET, check_runnable, tl, triton

__all__ = ["INTERPRET", "MoEConfig", "kernel_constants", "moe_config", "sort_constants", "sort_pairs",
           "sort_pairs_fast", "triton_fused_moe"]


@dataclass(frozen=True)
class MoEConfig:
    """Launch parameters of both kernels: sorted rows per block (``block_m``), output features
    per program (``block_n``: per half, gate and up, in the gate_up kernel; ``block_n_down`` in
    the down kernel), the K step, warps and pipeline depth."""

    block_m: int
    block_n: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int


# By the average rows per expert (T * k / E) up to which each applies; for 2-byte inputs
# (fp32 halves block_k so a stage takes the same shared memory). Untuned starting points.
_TABLE = (
    (4, MoEConfig(16, 32, 64, 128, 4, 4)),  # decode: a pair or a few per expert
    (16, MoEConfig(16, 64, 64, 128, 4, 4)),
    (48, MoEConfig(32, 64, 64, 128, 4, 4)),
    (128, MoEConfig(64, 64, 128, 64, 4, 4)),
    (float("inf"), MoEConfig(128, 64, 128, 64, 8, 3)),  # prefill
)
_INTERPRETER_CONFIG = MoEConfig(16, 16, 32, 32, 4, 1)  # tiny tests: several K steps and N tiles


def moe_config(num_pairs: int, num_experts: int, element_size: int) -> MoEConfig:
    """The launch parameters for ``num_pairs`` token-expert pairs over ``num_experts``."""
    if INTERPRET:
        return _INTERPRETER_CONFIG
    rows = num_pairs / num_experts
    cfg = next(c for limit, c in _TABLE if rows <= limit)
    if element_size > 2:
        cfg = MoEConfig(cfg.block_m, cfg.block_n, cfg.block_n_down, max(16, cfg.block_k // 2), cfg.num_warps,
                        min(cfg.num_stages, 3))
    return cfg


def sort_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)`` for ``topk_ids [T, k]`` (see the module's step 1), on
    the ids' device without a host sync: ``sorted_pairs`` (int32, a multiple of ``block_m``
    long) lists each expert's pairs in pair order, its run padded with ``T * k`` to a whole
    number of blocks, the runs in expert order, then padding; ``block_expert`` (int32) is each
    block's expert, ``num_experts`` for the blocks past the runs."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    row = padded_end[expert] - padded[expert] + torch.arange(pairs, device=device) - run_start[expert]
    blocks = (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m  # the padded total's upper bound
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[row] = order.to(torch.int32)
    block_start = torch.arange(0, blocks * block_m, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


if HAS_TRITON:

    @triton.jit
    def _sort_pairs_kernel(IDS, SORTED, BLOCK_EXPERT, OFFSETS, num_pairs, num_experts, num_rows,
                           BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                           FILL: tl.constexpr):
        """``sort_pairs`` in one program for at most ``P_BLOCK`` pairs: the pairs sorted by
        ``expert * P_BLOCK + pair`` (so stably by expert), each expert's count (a histogram)
        and padded run, then sorted position ``s`` goes to row ``s + offset[expert]``, offset
        being the padded run's start less the unpadded one's. ``OFFSETS`` is an ``E_BLOCK``
        scratch: the per-expert offsets go through it to be read per pair."""
        s = tl.arange(0, P_BLOCK)
        valid = s < num_pairs
        ids = tl.load(IDS + s, mask=valid, other=0).to(tl.int32)
        key = tl.sort(tl.where(valid, ids * P_BLOCK + s, E_BLOCK * P_BLOCK))  # invalid lanes last
        pair = key % P_BLOCK
        expert = key // P_BLOCK
        counts = tl.histogram(ids, E_BLOCK, mask=valid)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offsets = tl.cumsum(padded, 0) - padded - (tl.cumsum(counts, 0) - counts)
        tl.store(OFFSETS + tl.arange(0, E_BLOCK), offsets)
        # padding and expert-less blocks everywhere first (a constant bound: P_BLOCK and
        # E_BLOCK bound the rows, and the interpreter takes no runtime loop bound here)
        for r0 in range(0, P_BLOCK + E_BLOCK * (BLOCK_M - 1), FILL):
            r = r0 + tl.arange(0, FILL)
            tl.store(SORTED + r, tl.zeros([FILL], dtype=tl.int32) + num_pairs, mask=r < num_rows)
            tl.store(BLOCK_EXPERT + r, tl.zeros([FILL], dtype=tl.int32) + num_experts, mask=r < num_rows // BLOCK_M)
        tl.debug_barrier()  # the fills and offsets written (one program: a block-wide barrier orders them)
        row = s + tl.load(OFFSETS + expert, mask=valid, other=0)
        tl.store(SORTED + row, pair, mask=valid)
        tl.store(BLOCK_EXPERT + row // BLOCK_M, expert, mask=valid)  # every block of a run holds a pair

    @triton.jit
    def _gate_up_kernel(X, W, OUT, SORTED, BLOCK_EXPERT, num_pairs, num_experts,
                        stride_x, stride_we, stride_wn, stride_wk, stride_out,
                        TOP_K: tl.constexpr, N: tl.constexpr, K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        """``silu(x W_gate^T) * (x W_up^T)`` for one block of sorted rows (one expert) and
        ``BLOCK_N`` of its ``N = I`` features; ``W [E, 2N, K]`` rows ``[gate | up]``."""
        block = tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + block)
        if expert >= num_experts:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SORTED + rows)
        valid = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols < N) | EVEN_N  # a constant mask folds away
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + token[:, None] * stride_x + ks[None, :]
        gate_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        up_ptrs = gate_ptrs + N * stride_wn
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (ks < K - k0) | EVEN_K
            a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
            gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        act = gate / (1.0 + tl.exp(-gate)) * up
        # padding rows too (zeros): the down kernel then reads whole blocks without a row mask
        out_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, act.to(OUT.dtype.element_ty), mask=col_ok[None, :])

    @triton.jit
    def _down_kernel(A, W, OUT, SORTED, BLOCK_EXPERT, ROUTE_WEIGHTS, num_pairs, num_experts,
                     stride_a, stride_we, stride_wn, stride_wk, stride_out,
                     N: tl.constexpr, K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_K: tl.constexpr):
        """``route_weight * (a W_down^T)`` for one block of sorted rows (one expert) and
        ``BLOCK_N`` of the ``N = H`` outputs, each row stored at its pair's place."""
        block = tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + block)
        if expert >= num_experts:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SORTED + rows)
        valid = pair < num_pairs
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols < N) | EVEN_N  # a constant mask folds away
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
        w_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (ks < K - k0) | EVEN_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0).to(DOT_DTYPE)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        route = tl.load(ROUTE_WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * route[:, None]
        out_ptrs = OUT + pair.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


SORT_KERNEL_MAX_PAIRS = 4096  # above: torch's sort, whose dozen launches no longer matter


def sort_pairs_fast(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort_pairs``'s result, in one kernel launch up to ``SORT_KERNEL_MAX_PAIRS`` pairs
    (decode steps: torch's version is about twenty small launches), else by ``sort_pairs``."""
    pairs = topk_ids.numel()
    if pairs > SORT_KERNEL_MAX_PAIRS or pairs == 0:
        return sort_pairs(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    rows = (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m * block_m
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    constants = sort_constants(pairs, num_experts, block_m)
    offsets = torch.empty(constants["E_BLOCK"], dtype=torch.int32, device=ids.device)
    _sort_pairs_kernel[(1,)](ids, sorted_pairs, block_expert, offsets, pairs, num_experts, rows, **constants)
    return sorted_pairs, block_expert


@lru_cache(maxsize=256)
def sort_constants(pairs: int, num_experts: int, block_m: int) -> dict:
    """The sort kernel's compile-time arguments and warps for ``pairs`` pairs (cached: a
    decode step asks with the same few values every layer; callers must not change it)."""
    p_block = max(16, triton.next_power_of_2(pairs))
    return dict(BLOCK_M=block_m, P_BLOCK=p_block,
                E_BLOCK=max(32, triton.next_power_of_2(num_experts)),  # histogram bins: a warp's lanes at least
                FILL=1024, num_warps=4 if p_block <= 1024 else 8)


@lru_cache(maxsize=256)
def kernel_constants(cfg: MoEConfig, dtype: torch.dtype, hidden: int, inner: int, top_k: int) -> tuple[dict, dict]:
    """The compile-time arguments, warps and stages of the gate_up and the down kernel
    (cached, as ``sort_constants``)."""
    dot_dtype = _dot_dtype(dtype)
    precision = "ieee" if dot_dtype == tl.float32 else "tf32"  # ignored for 16-bit operands
    common = dict(DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    gate_up = dict(common, TOP_K=top_k, N=inner, K=hidden, BLOCK_N=cfg.block_n, EVEN_N=inner % cfg.block_n == 0,
                   EVEN_K=hidden % cfg.block_k == 0)
    down = dict(common, N=hidden, K=inner, BLOCK_N=cfg.block_n_down, EVEN_N=hidden % cfg.block_n_down == 0,
                EVEN_K=inner % cfg.block_k == 0)
    return gate_up, down


def _dot_dtype(dtype: torch.dtype):
    """The ``tl.dot`` operand type: the inputs' (the interpreter widens bf16, which NumPy lacks)."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRET else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def triton_fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w_gate_up: torch.Tensor, w_down: torch.Tensor, config: MoEConfig | None = None) -> torch.Tensor:
    """``fused_moe``'s result (same arguments: ``x [T, H]``, ``topk_ids`` and ``topk_weights
    [T, k]``, ``w_gate_up [E, 2I, H]`` rows ``[gate | up]``, ``w_down [E, H, I]``) from the two
    grouped-GEMM kernels; ``config`` overrides ``moe_config``'s choice (benchmarks)."""
    check_runnable(x, "the fused MoE kernels", __name__)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inner2, _ = w_gate_up.shape
    inner = inner2 // 2
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype}, the expert weights {w_gate_up.dtype} and {w_down.dtype}: one dtype")
    if tuple(w_down.shape) != (num_experts, hidden, inner) or w_gate_up.shape[2] != hidden:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} for x "
                         f"{tuple(x.shape)}: expected [E, 2I, {hidden}] and [E, {hidden}, I]")
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    w_down = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    cfg = config or moe_config(pairs, num_experts, x.element_size())
    sorted_pairs, block_expert = sort_pairs_fast(topk_ids, num_experts, cfg.block_m)
    route_weights = topk_weights.reshape(-1).contiguous()
    blocks = block_expert.numel()
    gate_up, down = kernel_constants(cfg, x.dtype, hidden, inner, top_k)
    act = torch.empty(sorted_pairs.numel(), inner, dtype=x.dtype, device=x.device)
    # grid: the column tiles of a block launch together (its rows are read once from memory,
    # then from L2), the blocks of an expert one after the other (its weights likewise)
    _gate_up_kernel[(triton.cdiv(inner, cfg.block_n), blocks)](
        x, w_gate_up, act, sorted_pairs, block_expert, pairs, num_experts,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), act.stride(0), **gate_up)
    rows = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(hidden, cfg.block_n_down), blocks)](
        act, w_down, rows, sorted_pairs, block_expert, route_weights, pairs, num_experts,
        act.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), rows.stride(0), **down)
    return rows.view(num_tokens, top_k, hidden).sum(dim=1) if top_k > 1 else rows
