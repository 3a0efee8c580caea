"""Fused Triton GEMV kernels for decode steps of up to 64 rows.

At one to a few dozen rows a projection ``y = x W^T`` reads every weight once and does two
flops per weight and row: it is bound by the weight read. The kernel here streams ``W [N, K]``
once, at about cuBLAS's bandwidth (see ``_config`` for measurements), and folds the
element-wise work that sits around the decoder's projections into the same pass, so those
kernels and their launches disappear:

* ``gemv(x, weight, bias)``: ``F.linear`` for at most ``GEMV_MAX_ROWS`` rows.
* ``gemv(..., silu_mul=True)``: for a ``[gate | up]`` weight (``N = 2I``), each program
  computes a block of gate rows and the matching up rows, rounds both to the dtype (as the
  GEMM output would be) and returns ``torch_silu_and_mul`` of them: ``[M, I]``.
* ``rmsnorm_gemv(x, residual, norm_weight, eps, weight, bias)``: ``torch_add_rmsnorm``
  (``triton_fused``'s reference, same rounding points) as a prologue, then the GEMV on the
  normalised rows. Returns ``(y, x + residual)``. Every program recomputes the row sums and
  their statistics from ``x`` and ``residual`` (a few KB at one row, read from L2), so no
  program waits on another; the programs of the first output block also store the sum. The
  cost grows with the rows: from about four rows a separate ``add_rmsnorm`` kernel then
  ``gemv`` is faster (``benchmarks/check_gemv.py``). ``silu_mul`` as for ``gemv``.
* ``layernorm_gemv(x, residual, norm_weight, norm_bias, eps, weight, bias)``: the same with
  ``torch_add_layernorm`` (LayerNorm with a bias, as Whisper's decoder has) as the prologue;
  its statistics take a second pass over the summed rows (the centred squares).
* ``gelu=True`` (``gemv``, ``layernorm_gemv``): ``F.gelu`` (erf) of the rounded output, for
  an MLP's first projection.
* ``kv_write=KVWrite(kv_cache, slot_mapping, first)``: the epilogue also stores the keys and
  values among the output features (a fused q/k/v projection's) into their paged-cache
  slots, so no cache-write kernels follow (the attention then runs with ``write_kv=False``).

How: each program owns ``BLOCK_N`` output features and walks K in ``BLOCK_K`` steps. The
input rows are padded to 16, 32 or 64 columns and the step is a tensor-core ``tl.dot`` of the
weight tile ``[BLOCK_N, BLOCK_K]`` with the transposed rows ``[BLOCK_K, cols]`` (the "swapped"
small-M GEMM: the padding costs arithmetic, which is idle here, never bytes). The weight tile
is loaded along K (contiguous, so the loads can be vectorised) and software-pipelined
``num_stages`` deep (or, with ``GemvConfig.tma``, through the copy engine: measured no faster
on the H200). Where the output tiles are too few to give every multiprocessor a program (o
and down at 64 features a tile), ``split_k`` programs share a tile's K: each stores an fp32
partial and the last to arrive sums them in a fixed order and runs the epilogue (see
``_sum_splits``), so the result does not depend on timing and no reduce kernel follows.

At the Llama-3.1-8B shapes on an H200 these beat cuBLAS for gate_up (with SiLU * up) at every
row count up to 64 and for o up to about 32 rows, tie for down, and lose for qkv above 16 rows
and for o at 64; ``mstar.model.llama.modeling.DECODE_GEMV`` uses them where they win.

Everything accumulates in fp32; the output is in ``x``'s dtype (all inputs must share it).
Wrappers allocate outputs of sizes fixed by the inputs' shapes and never read a tensor on the
host, so they can be captured in a CUDA graph. Kernels run on CUDA tensors, or on CPU tensors
under Triton's interpreter (see ``mstar.layers.triton_support``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mstar.layers.triton_support import (
    HAS_TRITON,
    INTERPRET,
    as_rows,
    check_runnable,
    launch_options,
    pdl,
    pdl_late_trigger,
    pdl_prefetch_bytes,
    pdl_start,
    pdl_wait,
    tl,
    triton,
)

M_PAD = 16  # the narrowest tl.dot: input rows are padded to it (or to 32, 64)
GEMV_MAX_ROWS = 64
SMS = 132  # an H200's multiprocessors: what the split-K rule fills


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output features per program, K step, warps, pipeline depth, and
    how many programs share one output tile's K (``split_k``; 0 picks it from the tile count)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    tma: bool = False  # weight tiles through the copy engine (a host tensor descriptor)


_INTERPRETER_CONFIG = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=1)


def padded_rows(m: int) -> int:
    """The dot's column count for ``m`` rows: 16, 32 or 64."""
    return max(M_PAD, triton.next_power_of_2(m)) if HAS_TRITON else M_PAD


def auto_split_k(tiles: int, k: int, block_k: int) -> int:
    """The fewest K splits (a power of two, each a whole number of ``block_k`` steps) that
    give every multiprocessor a program: ``tiles * split >= SMS``."""
    split = 1
    while tiles * split < SMS and k % (2 * split * block_k) == 0:
        split *= 2
    return split


# Swept on an H200 (benchmarks/check_gemv.py --sweep 64 32 16; 2026-12-03), Llama-3.1-8B
# shapes, bf16, by (padded rows, output features, K, SiLU * up): the separate-norm kernels
# above two rows. Microseconds per launch in a CUDA graph, weights cycled past the L2,
# add_rmsnorm included for qkv and gate_up: the sweep's best, then the second run's timing of
# the same config; cuBLAS (+ add_rmsnorm, + silu_and_mul) of that run in brackets. The second
# run swept the same candidates with the weights through the copy engine (``tma``): none beat
# these by more than the runs' spread (0.5 us).
_TUNED = {
    (16, 6144, 4096, False): GemvConfig(64, 64, 4, 6, 2),  # qkv 18.3, 18.5 (18.5)
    (16, 14336, 4096, True): GemvConfig(64, 128, 4, 3, 1),  # gate_up 59.4, 60.0 (62.3)
    (32, 6144, 4096, False): GemvConfig(64, 64, 4, 6, 2),  # qkv 19.2, 19.4 (18.8)
    (32, 4096, 4096, False): GemvConfig(32, 256, 4, 3, 2),  # o 12.5, 12.6 (12.9)
    (32, 14336, 4096, True): GemvConfig(64, 64, 4, 3, 1),  # gate_up 60.6, 62.9 (64.0)
    (32, 4096, 14336, False): GemvConfig(64, 128, 4, 3, 4),  # down 32.3, 32.8 (33.5)
    (64, 6144, 4096, False): GemvConfig(64, 128, 4, 3, 2),  # qkv 21.4, 21.6 (19.2)
    (64, 4096, 4096, False): GemvConfig(64, 128, 4, 3, 4),  # o 14.7, 14.8 (11.6)
    (64, 14336, 4096, True): GemvConfig(64, 64, 4, 3, 1),  # gate_up 61.8, 64.1 (69.2)
    (64, 4096, 14336, False): GemvConfig(64, 128, 4, 3, 4),  # down 35.1, 35.5 (36.2)
    # Whisper large's o / cross o (1280 -> 1280) and fc2 (5120 -> 1280), swept on an H100
    # (CHECK_GEMV_DIMS=1280,3840,5120 check_gemv.py --rows 1 4 --sweep 16; 2026-12-07): the
    # rules above give 40 programs and no K split there (o 4.5 us, fc2 9.9, cuBLAS 5.0, 9.0)
    (16, 1280, 1280, False): GemvConfig(64, 128, 4, 6, 1),  # o 4.2
    (16, 1280, 5120, False): GemvConfig(32, 256, 4, 3, 4),  # fc2 8.2
}


def _config(n: int, k: int, m_rows: int, norm: bool, silu_mul: bool, element_size: int) -> GemvConfig:
    """Launch parameters for ``n`` output features (per half for ``silu_mul``) over ``k``
    at ``m_rows`` padded rows: ``_TUNED`` where it has the shape, else the rules below; the
    rules are for 2-byte weights (wider ones take the same bytes per step, two stages).

    The rules for 16 padded rows are the best of the sweep at 1 and 4 rows (o 4096x4096 and
    down 14336->4096 11.0 and 29.8 us, 3.0 and 3.9 TB/s, cuBLAS 12.6 and 30.8; norm + qkv
    4096->6144 18.6 / 22.3 us; norm + gate_up + SiLU*up 4096->2x14336 60.0 / 60.4 us, 3.9
    TB/s). The norm kernels take wider blocks: their programs each re-derive the normalised
    rows, a cost per program, not per weight. Wider rows take 64-feature tiles (the narrowest
    Hopper warpgroup product) and split K until every multiprocessor has a program."""
    if INTERPRET:
        return _INTERPRETER_CONFIG
    tuned = None if norm or element_size != 2 else _TUNED.get((m_rows, n, k, silu_mul))
    if tuned is not None:
        return tuned
    if m_rows > M_PAD:
        cfg = GemvConfig(block_n=64, block_k=64 if silu_mul else 128, num_warps=4, num_stages=3, split_k=0)
    elif silu_mul:  # two weight tiles (gate and up) per step
        cfg = GemvConfig(block_n=128, block_k=128, num_warps=8, num_stages=3)
    elif norm:
        cfg = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    else:
        cfg = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=5)
    if element_size <= 2:
        return cfg
    return replace(cfg, block_k=max(16, cfg.block_k * 2 // element_size), num_stages=2)  # fits shared memory


_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters (int32 zeros) for ``tiles`` output tiles on ``device``.

    One buffer per device, shared by every launch: the kernels leave it zeroed (the last
    program of a tile resets its counter), and launches on one stream run one at a time.
    Kernels on two streams at once must not both split K. It grows only outside a CUDA-graph
    capture (a capture would record the zero fill instead of running it): a captured step
    must have run once before, as the graph runners' warm-ups do."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K GEMV counters must be allocated before a CUDA-graph capture: "
                               "run the step once eagerly first")
        buf = _counters[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


# --------------------------------------------------------------------------- kernels
if HAS_TRITON:

    @triton.jit
    def _summed(X, RESIDUAL, x_offs, r_offs, mask, HAS_RESIDUAL: tl.constexpr):
        """``x + residual`` at the given offsets, rounded to x's dtype as the torch add rounds."""
        x = tl.load(X + x_offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(RESIDUAL + r_offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        return x

    @triton.jit
    def _row_stats(X, RESIDUAL, SUM_OUT, M, eps, stride_x, stride_r, stride_s, store_sum,
                   K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LAYER_NORM: tl.constexpr, M_STAT: tl.constexpr,
                   BLOCK_S: tl.constexpr, M_ROWS: tl.constexpr):
        """The norm's statistics of the summed rows ``s = x + residual``, as two ``[M_ROWS]``
        vectors ``(mean, rstd)`` (zero past the ``M_STAT`` rows): RMSNorm's ``(0, rsqrt(mean(s^2)
        + eps))``, or with ``LAYER_NORM`` the mean and ``rsqrt(mean((s - mean)^2) + eps)`` (a
        second pass over the rows for the centred squares, as ``add_layernorm`` computes them).
        ``s`` is stored to ``SUM_OUT`` where ``store_sum``. The rows are read as ``[M_STAT,
        BLOCK_S]`` tiles (only the real rows, padded to a power of two) in an unrolled loop, so
        the loads go out together: every program pays about one L2 round trip a pass here, not
        one per step."""
        rows = tl.arange(0, M_STAT)
        row_mask = rows < M
        total = tl.zeros([M_STAT], dtype=tl.float32)
        square_sum = tl.zeros([M_STAT], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_S):
            ks = k0 + tl.arange(0, BLOCK_S)
            mask = row_mask[:, None] & (ks[None, :] < K)
            s = _summed(X, RESIDUAL, rows[:, None] * stride_x + ks[None, :], rows[:, None] * stride_r + ks[None, :],
                        mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(SUM_OUT + rows[:, None] * stride_s + ks[None, :], s, mask=mask & store_sum)
            s = s.to(tl.float32)
            total += tl.sum(s, axis=1)
            square_sum += tl.sum(s * s, axis=1)
        mean = tl.zeros([M_STAT], dtype=tl.float32)
        if LAYER_NORM:
            mean = total / K
            square_sum = tl.zeros([M_STAT], dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_S):
                ks = k0 + tl.arange(0, BLOCK_S)
                mask = row_mask[:, None] & (ks[None, :] < K)
                s = _summed(X, RESIDUAL, rows[:, None] * stride_x + ks[None, :],
                            rows[:, None] * stride_r + ks[None, :], mask, HAS_RESIDUAL)
                centred = tl.where(mask, s.to(tl.float32) - mean[:, None], 0.0)
                square_sum += tl.sum(centred * centred, axis=1)
        rstd = tl.where(row_mask, tl.rsqrt(square_sum / K + eps), 0.0)
        # Spread onto the dot's padded columns: column m takes row m's values.
        cols = tl.arange(0, M_ROWS)
        same = cols[:, None] == rows[None, :]
        return (tl.sum(tl.where(same, mean[None, :], 0.0), axis=1),
                tl.sum(tl.where(same, rstd[None, :], 0.0), axis=1))

    @triton.jit
    def _sum_splits(acc, SPLITS, split_stride, pid_k, mask, SPLIT_K: tl.constexpr):
        """The fp32 sum over the ``SPLIT_K`` partials at ``SPLITS + s * split_stride``, this
        program's own (``acc``) taken from registers, in split order (so the result does not
        depend on which program finished last). Loads only where ``mask``; past L1, which is
        not coherent with the other programs' stores."""
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            other = tl.load(SPLITS + s * split_stride, mask=mask & (pid_k != s), other=0.0, cache_modifier=".cg")
            total += tl.where(pid_k == s, acc, other)
        return total

    @triton.jit
    def _prefetch_l2(W, w_rows, stride_w, k_lo, K: tl.constexpr, PREFETCH_K: tl.constexpr):
        """Ask L2 for the first ``PREFETCH_K`` weights of each of ``w_rows`` from column
        ``k_lo`` (within K): one ``prefetch.global.L2`` per 128-byte line (the weights never
        change during a step, so this may run before the wait for the kernel before)."""
        LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
        lines = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)
        ptrs = W + w_rows[:, None] * stride_w + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count of a padding
    def _gemv_kernel(
        X, RESIDUAL, NORM_W, NORM_B, W, BIAS, Y, SUM_OUT, PARTIAL, COUNTERS, CACHE, SLOTS,
        M, N_OUT, eps, cache_kv_stride,
        stride_x, stride_r, stride_w, stride_y, stride_s,
        K: tl.constexpr, NORM: tl.constexpr, LAYER_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, GELU: tl.constexpr,
        WRITE_KV: tl.constexpr, KV_FIRST: tl.constexpr, KV_WIDTH: tl.constexpr,
        M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_STAT: tl.constexpr, BLOCK_S: tl.constexpr,
        SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
        PREFETCH_K: tl.constexpr, LATE_TRIGGER: tl.constexpr,
    ):
        """Output features ``[pid * BLOCK_N, +BLOCK_N)`` of ``Y [M, N_OUT]`` for all M rows,
        over K slice ``[pid_k * K_SPLIT, +K_SPLIT)`` (the whole K unless ``SPLIT_K > 1``).

        With ``SILU_MUL`` the weight holds ``2 * N_OUT`` rows ``[gate | up]`` and the program
        also computes the up rows ``N_OUT + n``. With ``NORM`` the GEMV's input is
        ``rmsnorm(x + residual) * NORM_W`` (rounded as ``torch_add_rmsnorm``), or with
        ``LAYER_NORM`` too ``layernorm(x + residual) * NORM_W + NORM_B`` (as
        ``torch_add_layernorm``). ``GELU`` applies erf GELU to the (rounded) output. With
        ``WRITE_KV`` output features ``[KV_FIRST, +KV_WIDTH)`` are also stored as keys and the
        next ``KV_WIDTH`` as values into the paged cache ``CACHE`` (flat ``[2, slots,
        KV_WIDTH]``, values ``cache_kv_stride`` after the keys) at row m's slot ``SLOTS[m]``. K is a
        compile-time constant: one compiled kernel per weight shape. Launched with PDL, the
        program first asks L2 for its first ``PREFETCH_K`` weights of each feature (while the
        kernel before may still run), then waits for that kernel. It lets the next kernel start
        at its own start, or with ``LATE_TRIGGER`` once its main loop is done (so that a chain of
        GEMVs does not fill the GPU with programs waiting on each other)."""
        if not LATE_TRIGGER:
            pdl_start(PDL)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_lo = pid_k * K_SPLIT
        # Without a K mask (full-width vector loads) when every step lies inside K.
        EVEN_K: tl.constexpr = (K % BLOCK_K == 0) and (K_SPLIT * SPLIT_K == K)
        rows = tl.arange(0, M_ROWS)
        row_mask = rows < M
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range features read row 0 (always there) and are never stored, so the weight
        # loads need no feature mask.
        if not TMA:  # else W is a tensor descriptor of [N, K] in [BLOCK_N, BLOCK_K] blocks
            w_rows = tl.where(ns < N_OUT, ns, 0).to(tl.int64)
            w_ptrs = W + w_rows[:, None] * stride_w + offs_k[None, :]
            up_ptrs = w_ptrs + N_OUT * stride_w  # used only with SILU_MUL
            if PDL and PREFETCH_K > 0:
                _prefetch_l2(W, w_rows, stride_w, k_lo, K, PREFETCH_K)
                if SILU_MUL:
                    _prefetch_l2(W, w_rows + N_OUT, stride_w, k_lo, K, PREFETCH_K)
        pdl_wait(PDL)
        dtype = X.dtype.element_ty

        if NORM:
            # Statistics over the whole rows first; then each step re-derives its slice of
            # the normalised rows from L2 (never stored), its loads issued one step ahead
            # (``s_next``, ``g_next``) so that their latency hides behind the step before.
            mean, rstd = _row_stats(X, RESIDUAL, SUM_OUT, M, eps, stride_x, stride_r, stride_s,
                                    (pid == 0) & (pid_k == 0), K, HAS_RESIDUAL, LAYER_NORM, M_STAT, BLOCK_S, M_ROWS)
            x_offs = rows[None, :] * stride_x + offs_k[:, None]
            r_offs = rows[None, :] * stride_r + offs_k[:, None]
            s_next = _summed(X, RESIDUAL, x_offs, r_offs, row_mask[None, :] & (offs_k[:, None] < K), HAS_RESIDUAL)
            g_next = tl.load(NORM_W + offs_k, mask=offs_k < K, other=0.0)
            if LAYER_NORM:
                b_next = tl.load(NORM_B + offs_k, mask=offs_k < K, other=0.0)

        acc = tl.zeros([BLOCK_N, M_ROWS], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, M_ROWS], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):  # a trip count known at compile time
            ks = k_lo + k0 + tl.arange(0, BLOCK_K)
            if NORM:
                s, g = s_next, g_next
                ks_next = ks + BLOCK_K
                x_offs += BLOCK_K
                r_offs += BLOCK_K
                s_next = _summed(X, RESIDUAL, x_offs, r_offs, row_mask[None, :] & (ks_next[:, None] < K),
                                 HAS_RESIDUAL)
                g_next = tl.load(NORM_W + ks_next, mask=ks_next < K, other=0.0)
                if LAYER_NORM:  # fp32 throughout, one rounding at the end (as nn.LayerNorm)
                    b = b_next
                    b_next = tl.load(NORM_B + ks_next, mask=ks_next < K, other=0.0)
                    centred = s.to(tl.float32) - mean[None, :]
                    xt = (centred * rstd[None, :] * g.to(tl.float32)[:, None] + b.to(tl.float32)[:, None]).to(dtype)
                else:
                    normed = (s.to(tl.float32) * rstd[None, :]).to(dtype).to(tl.float32)
                    xt = (g.to(tl.float32)[:, None] * normed).to(dtype)
            else:
                mask = row_mask[None, :] & (ks[:, None] < K)
                xt = tl.load(X + rows[None, :] * stride_x + ks[:, None], mask=mask, other=0.0)
            if TMA:  # the copy engine fills rows and columns past the weight with zeros
                w = W.load([pid * BLOCK_N, k_lo + k0])
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=ks[None, :] < K, other=0.0)
            acc = tl.dot(w, xt, acc, input_precision="ieee")
            if SILU_MUL:
                if TMA:
                    w_up = W.load([N_OUT + pid * BLOCK_N, k_lo + k0])
                elif EVEN_K:
                    w_up = tl.load(up_ptrs)
                else:
                    w_up = tl.load(up_ptrs, mask=ks[None, :] < K, other=0.0)
                acc_up = tl.dot(w_up, xt, acc_up, input_precision="ieee")
            if not TMA:
                w_ptrs += BLOCK_K
                up_ptrs += BLOCK_K

        if LATE_TRIGGER:
            pdl_start(PDL)
        out_mask = (ns[:, None] < N_OUT) & row_mask[None, :]
        if SPLIT_K > 1:
            # Split-K without a second kernel: every program stores its fp32 partials
            # (``[SPLIT_K, gate (| up), N_OUT, M_ROWS]``) and counts itself in on the tile's
            # counter; the last to arrive sums the splits, runs the epilogue, stores, and
            # puts the counter back to zero for the next launch. The barrier makes all of
            # the program's partial stores precede the counting atomic (acq_rel, GPU scope).
            p_offs = ns[:, None] * M_ROWS + rows[None, :]
            p_mask = ns[:, None] < N_OUT
            split_stride = N_OUT * M_ROWS
            if SILU_MUL:
                split_stride = 2 * N_OUT * M_ROWS
            own = PARTIAL + pid_k * split_stride + p_offs
            tl.store(own, acc, mask=p_mask)
            if SILU_MUL:
                tl.store(own + N_OUT * M_ROWS, acc_up, mask=p_mask)
            tl.debug_barrier()
            last = tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
            acc = _sum_splits(acc, PARTIAL + p_offs, split_stride, pid_k, p_mask & last, SPLIT_K)
            if SILU_MUL:
                acc_up = _sum_splits(acc_up, PARTIAL + N_OUT * M_ROWS + p_offs, split_stride, pid_k, p_mask & last,
                                     SPLIT_K)
            tl.store(COUNTERS + pid, 0, mask=last)
            out_mask = out_mask & last
        if HAS_BIAS:
            acc += tl.load(BIAS + ns, mask=ns < N_OUT, other=0.0).to(tl.float32)[:, None]
        y = acc.to(dtype)
        if SILU_MUL:
            if HAS_BIAS:
                acc_up += tl.load(BIAS + N_OUT + ns, mask=ns < N_OUT, other=0.0).to(tl.float32)[:, None]
            # Gate and up rounded as the GEMM output is, then torch_silu_and_mul's rounding.
            gate = y.to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = (silu * up).to(dtype)
        if GELU:  # F.gelu of the rounded GEMM output: erf form, fp32, one rounding
            h = y.to(tl.float32)
            y = (0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))).to(dtype)
        tl.store(Y + rows[None, :] * stride_y + ns[:, None], y, mask=out_mask)
        if WRITE_KV:  # the keys and values among the features, into their cache slots
            f = ns - KV_FIRST
            in_kv = (f >= 0) & (f < 2 * KV_WIDTH)
            dst = tl.where(f >= KV_WIDTH, f - KV_WIDTH + cache_kv_stride, f)
            slot = tl.load(SLOTS + rows, mask=row_mask, other=0).to(tl.int64)
            tl.store(CACHE + slot[None, :] * KV_WIDTH + dst[:, None], y.to(CACHE.dtype.element_ty),
                     mask=out_mask & in_kv[:, None])


# -------------------------------------------------------------------------- wrappers
def _check_same(x: torch.Tensor, name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")


def _prefetch_columns(enabled: bool, programs: int, rows_per_program: int, k_split: int, element_size: int) -> int:
    """How many weight columns each program of a PDL launch asks L2 for before its wait: the
    launch's share of ``pdl_prefetch_bytes`` per program, a power of two of whole 128-byte
    lines, at most the program's K slice (0: none)."""
    line = 128 // element_size
    budget = pdl_prefetch_bytes() // max(1, programs * rows_per_program * element_size)
    if not enabled or budget < line:
        return 0
    return min(1 << (budget.bit_length() - 1), 1 << (k_split.bit_length() - 1))


@dataclass(frozen=True)
class KVWrite:
    """A GEMV epilogue's write of keys and values into a paged KV cache: output features
    ``[first, first + width)`` are row m's keys and the next ``width`` its values (``width =
    heads * head_dim`` of ``kv_cache [2, pages, page_size, heads, head_dim]``, contiguous),
    stored at flat slot ``slot_mapping[m]``, as ``mstar.layers.paged_kv.write_kv_cache``
    stores them. The GEMV's output still holds them."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    first: int

    @property
    def width(self) -> int:
        return self.kv_cache.shape[3] * self.kv_cache.shape[4]

    def check(self, x: torch.Tensor, rows: int, n_out: int) -> None:
        cache, slots = self.kv_cache, self.slot_mapping
        if cache.dim() != 5 or cache.shape[0] != 2 or not cache.is_contiguous():
            raise ValueError(f"kv_cache must be a contiguous [2, pages, page_size, heads, head_dim], "
                             f"got {tuple(cache.shape)}")
        if not 0 <= self.first <= n_out - 2 * self.width:
            raise ValueError(f"keys and values at features [{self.first}, +{2 * self.width}) do not fit "
                             f"{n_out} output features")
        if tuple(slots.shape) != (rows,) or cache.device != x.device or slots.device != x.device:
            raise ValueError(f"slot_mapping {tuple(slots.shape)} on {slots.device} does not fit {rows} rows "
                             f"on {x.device} (cache on {cache.device})")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
            weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            config: GemvConfig | None, *, norm_bias: torch.Tensor | None = None, gelu: bool = False,
            kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, launch, and return ``(y, summed)`` (``summed`` is ``x`` without a residual
    or without the norm). ``norm_bias`` makes the norm a LayerNorm."""
    check_runnable(x, "GEMV Triton kernels", __name__)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last is K)")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight [N, K] = {tuple(weight.shape)} expects {k}")
    _check_same(x, "weight", weight, (n, k))
    _check_same(x, "bias", bias, (n,))
    _check_same(x, "residual", residual, tuple(x.shape))
    _check_same(x, "norm_weight", norm_weight, (k,))
    _check_same(x, "norm_bias", norm_bias, (k,))
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K (its last dimension)")
    if silu_mul and n % 2:
        raise ValueError(f"silu_mul needs a [gate | up] weight with an even number of rows, got {n}")
    if silu_mul and gelu:
        raise ValueError("silu_mul and gelu are two epilogues: take one")
    n_out = n // 2 if silu_mul else n
    xs = as_rows(x)
    m = xs.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"GEMV kernels take at most GEMV_MAX_ROWS={GEMV_MAX_ROWS} rows, got {m}")
    if kv_write is not None:
        kv_write.check(x, m, n_out)
    norm = norm_weight is not None
    with_sum = norm and residual is not None
    rs = as_rows(residual) if with_sum else xs
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(xs) if with_sum else xs
    if m and n_out:
        m_rows = padded_rows(m)
        cfg = config or _config(n_out, k, m_rows, norm, silu_mul, weight.element_size())
        tiles = triton.cdiv(n_out, cfg.block_n)
        split = cfg.split_k or auto_split_k(tiles, k, cfg.block_k)
        k_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k  # whole steps per split
        if split > 1:
            partial = torch.empty(split, 2 if silu_mul else 1, n_out, m_rows, dtype=torch.float32, device=x.device)
            counters = _split_counters(x.device, tiles)
        else:
            partial = counters = y  # unused
        w_arg = weight
        # The copy engine needs 16-byte aligned rows; others take the pointer loads.
        tma = cfg.tma and (weight.stride(0) * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            w_arg = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
        on = pdl(xs)
        prefetch_k = _prefetch_columns(on and not tma, tiles * split, cfg.block_n * (2 if silu_mul else 1), k_split,
                                       weight.element_size())
        m_stat = triton.next_power_of_2(m)
        block_s = min(triton.next_power_of_2(k), (64 if INTERPRET else 4096) // m_stat)
        cache, slots = (kv_write.kv_cache, kv_write.slot_mapping) if kv_write is not None else (y, y)
        _gemv_kernel[(tiles, split)](
            xs, rs, norm_weight if norm else xs, norm_bias if norm_bias is not None else xs, w_arg,
            bias if bias is not None else weight, y, summed, partial, counters, cache, slots,
            m, n_out, eps, cache.stride(0) if kv_write is not None else 0,
            xs.stride(0), rs.stride(0), weight.stride(0), y.stride(0), summed.stride(0),
            K=k, NORM=norm, LAYER_NORM=norm and norm_bias is not None, HAS_RESIDUAL=with_sum,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, GELU=gelu, WRITE_KV=kv_write is not None,
            KV_FIRST=kv_write.first if kv_write is not None else 0,
            KV_WIDTH=kv_write.width if kv_write is not None else 0,
            M_ROWS=m_rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, M_STAT=m_stat, BLOCK_S=block_s,
            SPLIT_K=split, K_SPLIT=k_split, TMA=tma, PDL=on, PREFETCH_K=prefetch_k, LATE_TRIGGER=pdl_late_trigger(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(on),
        )
    y = y.view(*x.shape[:-1], n_out)
    return y, (summed.view(x.shape) if with_sum else x)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, *,
         gelu: bool = False, kv_write: KVWrite | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` of at most ``GEMV_MAX_ROWS`` rows
    (``config`` overrides the launch table, for benchmarks). With ``silu_mul`` the weight is
    ``[gate | up]`` and the result ``torch_silu_and_mul`` of the product, ``[..., N / 2]``;
    with ``gelu``, ``F.gelu`` of it. ``kv_write`` also stores the keys and values among the
    output features into a paged cache."""
    return _launch(x, None, None, 0.0, weight, bias, silu_mul, config, gelu=gelu, kv_write=kv_write)[0]


def rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, *,
                 config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(normed, weight, bias), summed)`` where ``(normed, summed) =
    torch_add_rmsnorm(x, residual, norm_weight, eps)``, in one kernel. With ``silu_mul`` the
    weight is ``[gate | up]`` and the first result is ``torch_silu_and_mul`` of the GEMV
    output, ``[..., N / 2]``. Without ``residual``, ``summed`` is ``x`` itself."""
    if norm_weight is None:
        raise ValueError("rmsnorm_gemv needs norm_weight")
    return _launch(x, residual, norm_weight, eps, weight, bias, silu_mul, config)


def layernorm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   norm_bias: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gelu: bool = False, kv_write: KVWrite | None = None,
                   config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(normed, weight, bias), summed)`` where ``(normed, summed) =
    torch_add_layernorm(x, residual, norm_weight, norm_bias, eps)``, in one kernel; ``gelu``
    and ``kv_write`` as for ``gemv``. Without ``residual``, ``summed`` is ``x`` itself."""
    if norm_weight is None or norm_bias is None:
        raise ValueError("layernorm_gemv needs norm_weight and norm_bias")
    return _launch(x, residual, norm_weight, eps, weight, bias, False, config, norm_bias=norm_bias, gelu=gelu,
                   kv_write=kv_write)
