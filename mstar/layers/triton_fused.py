"""Fused Triton kernels for the small element-wise work of a decoder step.

A Llama decode step spends as long in ~250 tiny element-wise kernels (RMSNorm as several
ops, residual adds, RoPE, SiLU and multiply, casts) as the weight-read floor leaves for them.
Three kernels replace them, each next to a pure-torch reference with the same rounding points:

* ``add_rmsnorm``: ``s = x + residual`` (rounded to the input dtype, as a torch add is), then
  RMSNorm of ``s`` with fp32 statistics, the normalised row rounded to the input dtype before
  the per-channel scale (as ``mstar.layers.norm.RMSNorm`` does). Returns ``(normed, s)``.
  Without a residual it is a plain RMSNorm.
* ``add_layernorm``: the same with LayerNorm (mean and variance in fp32, weight and bias
  applied in fp32, one rounding to the input dtype at the end, as ``torch.nn.LayerNorm`` does
  on the GPU). Returns ``(normed, s)``; without a residual it is a plain LayerNorm.
* ``silu_and_mul``: ``silu(gate) * up`` on the fused ``[gate | up]`` projection output.
* ``rotary_``: rotate-half (NeoX) RoPE applied to ``q`` and ``k`` in place, one program per
  (token, head), reading the per-token ``cos``/``sin`` rows (``[T, head_dim]``, both halves
  equal, as ``RotaryEmbedding.cos_sin`` makes them).

Every wrapper allocates outputs of sizes fixed by its inputs' shapes and never reads a tensor
on the host, so a decode step using them can be captured in a CUDA graph. Kernels run on CUDA
tensors, or on CPU tensors under Triton's interpreter when ``TRITON_INTERPRET=1`` is set
before this module is first imported. Triton is optional: without it the module imports and
``HAS_TRITON`` is False (the wrappers then raise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.layers.triton_support import (  # noqa: F401 (the kernel tests read INTERPRET here)
    HAS_TRITON,
    INTERPRET,
    as_rows,
    check_runnable,
    launch_options,
    pdl,
    pdl_start,
    pdl_wait,
    tl,
    triton,
)

_SILU_BLOCK = 1024


# ------------------------------------------------------------------ torch references
def torch_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)``; without ``residual`` the sum is ``x``."""
    summed = x if residual is None else x + residual
    x32 = summed.float()
    x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(summed.dtype), summed


def torch_add_layernorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layernorm(x + residual), x + residual)``; without ``residual`` the sum is ``x``."""
    summed = x if residual is None else x + residual
    normed = F.layer_norm(summed.float(), summed.shape[-1:], weight.float(), bias.float(), eps)
    return normed.to(summed.dtype), summed


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., gate | up]`` (two equal halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (see ``mstar.layers.rotary``)."""
    from mstar.layers.rotary import apply_rotary

    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# --------------------------------------------------------------------------- kernels
if HAS_TRITON:

    @triton.jit
    def _row_plus_residual(X, RESIDUAL, SUM_OUT, row, stride_x, stride_r, stride_s, cols, mask,
                           HAS_RESIDUAL: tl.constexpr):
        """Row ``row`` of ``X``, plus the same row of ``RESIDUAL`` (rounded to X's dtype, as
        the torch add rounds) stored to ``SUM_OUT`` when ``HAS_RESIDUAL``."""
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(RESIDUAL + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(SUM_OUT + row * stride_s + cols, x, mask=mask)
        return x

    @triton.jit
    def _add_rmsnorm_kernel(
        X, RESIDUAL, WEIGHT, OUT, SUM_OUT,
        stride_x, stride_r, stride_o, stride_s,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = _row_plus_residual(X, RESIDUAL, SUM_OUT, row, stride_x, stride_r, stride_s, cols, mask, HAS_RESIDUAL)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.rsqrt(mean_square + eps)).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layernorm_kernel(
        X, RESIDUAL, WEIGHT, BIAS, OUT, SUM_OUT,
        stride_x, stride_r, stride_o, stride_s,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = _row_plus_residual(X, RESIDUAL, SUM_OUT, row, stride_x, stride_r, stride_s, cols, mask, HAS_RESIDUAL)
        x32 = x.to(tl.float32)
        mean = tl.sum(x32, axis=0) / n_cols
        centred = tl.where(mask, x32 - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (centred * rstd * w + b).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(GATE_UP, OUT, stride_gu, stride_o, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        gate = tl.load(GATE_UP + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(GATE_UP + row * stride_gu + inner + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)  # F.silu's rounding
        tl.store(OUT + row * stride_o + cols, (silu * up).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_head(X, c, s, half_cols, mask, HALF: tl.constexpr):
        """Rotate one head in place: ``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)``, each product
        rounded to the tensor's dtype before the sum (as the torch reference rounds).
        Returns the rotated halves (in the tensor's dtype)."""
        x1 = tl.load(X + half_cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + HALF + half_cols, mask=mask, other=0.0).to(tl.float32)
        dtype = X.dtype.element_ty
        x1c = (x1 * c).to(dtype).to(tl.float32)
        x2s = (x2 * s).to(dtype).to(tl.float32)
        x2c = (x2 * c).to(dtype).to(tl.float32)
        x1s = (x1 * s).to(dtype).to(tl.float32)
        r1, r2 = (x1c - x2s).to(dtype), (x2c + x1s).to(dtype)
        tl.store(X + half_cols, r1, mask=mask)
        tl.store(X + HALF + half_cols, r2, mask=mask)
        return r1, r2

    @triton.jit
    def _rotary_kernel(
        Q, K, V, COS, SIN, CACHE_K, CACHE_V, SLOTS,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cs,
        stride_c_slot, stride_c_head,
        num_q_heads,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, WRITE_CACHE: tl.constexpr, PDL: tl.constexpr,
    ):
        """One (token, head): q heads first, then k heads; with ``WRITE_CACHE`` a k head's
        program also stores the rotated key and the token's value of that head into the
        paged cache at the token's slot (the attention then skips its own write)."""
        pdl_start(PDL)
        pdl_wait(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half_cols = tl.arange(0, BLOCK_HALF)
        mask = half_cols < HALF
        c = tl.load(COS + tok * stride_cs + half_cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + tok * stride_cs + half_cols, mask=mask, other=0.0).to(tl.float32)
        if head < num_q_heads:
            _rotate_head(Q + tok * stride_q_tok + head * stride_q_head, c, s, half_cols, mask, HALF)
        else:
            kv_head = head - num_q_heads
            r1, r2 = _rotate_head(K + tok * stride_k_tok + kv_head * stride_k_head, c, s, half_cols, mask, HALF)
            if WRITE_CACHE:
                slot = tl.load(SLOTS + tok).to(tl.int64)
                dst = slot * stride_c_slot + kv_head * stride_c_head
                tl.store(CACHE_K + dst + half_cols, r1.to(CACHE_K.dtype.element_ty), mask=mask)
                tl.store(CACHE_K + dst + HALF + half_cols, r2.to(CACHE_K.dtype.element_ty), mask=mask)
                src = V + tok * stride_v_tok + kv_head * stride_v_head
                v1 = tl.load(src + half_cols, mask=mask, other=0.0)
                v2 = tl.load(src + HALF + half_cols, mask=mask, other=0.0)
                tl.store(CACHE_V + dst + half_cols, v1.to(CACHE_V.dtype.element_ty), mask=mask)
                tl.store(CACHE_V + dst + HALF + half_cols, v2.to(CACHE_V.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------- wrappers
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``torch_add_rmsnorm``: ``(rmsnorm(x + residual), x + residual)`` in one kernel."""
    check_runnable(x, "fused Triton kernels", __name__)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} does not fit rows of {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    xs = as_rows(x)
    rs = as_rows(residual) if residual is not None else xs
    out = torch.empty(xs.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(xs) if residual is not None else xs
    if xs.shape[0]:
        on = pdl(xs)
        _add_rmsnorm_kernel[(xs.shape[0],)](
            xs, rs, weight, out, summed,
            xs.stride(0), rs.stride(0), out.stride(0), summed.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(n), PDL=on, **launch_options(on),
        )
    return out.view(x.shape), (summed.view(x.shape) if residual is not None else x)


def add_layernorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``torch_add_layernorm``: ``(layernorm(x + residual), x + residual)`` in one kernel;
    the normalised rows come out in ``x``'s dtype."""
    check_runnable(x, "fused Triton kernels", __name__)
    n = x.shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"LayerNorm weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not fit "
                         f"rows of {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    xs = as_rows(x)
    rs = as_rows(residual) if residual is not None else xs
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(xs) if residual is not None else xs
    if xs.shape[0]:
        on = pdl(xs)
        _add_layernorm_kernel[(xs.shape[0],)](
            xs, rs, weight, bias, out, summed,
            xs.stride(0), rs.stride(0), out.stride(0), summed.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(n), PDL=on, **launch_options(on),
        )
    return out.view(x.shape), (summed.view(x.shape) if residual is not None else x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused ``torch_silu_and_mul``: ``[..., 2I] -> [..., I]``."""
    check_runnable(gate_up, "fused Triton kernels", __name__)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {gate_up.shape[-1]}")
    inner = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)
    out = torch.empty(rows.shape[0], inner, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inner:
        grid = (rows.shape[0], triton.cdiv(inner, _SILU_BLOCK))
        on = pdl(rows)
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inner, BLOCK=_SILU_BLOCK, PDL=on,
                                   **launch_options(on))
    return out.view(*gate_up.shape[:-1], inner)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
            slot_mapping: torch.Tensor | None = None) -> None:
    """Fused ``torch_rotary``, in place: rotates ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (views
    with a contiguous head dimension, e.g. of the fused qkv output) by ``cos``/``sin [T, D]``.

    With ``kv_cache`` (``[2, pages, page_size, Hkv, D]``), ``v`` and ``slot_mapping [T]``, the
    same kernel also writes the rotated keys and the values into the cache at the tokens'
    flat slots, as ``mstar.layers.attention.write_kv_cache`` would after the rotation."""
    check_runnable(q, "fused Triton kernels", __name__)
    tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin must both be [{tokens}, {head_dim}] with equal strides, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rotary needs an even head_dim and contiguous head and cos/sin dimensions")
    write = kv_cache is not None
    if write:
        if v is None or slot_mapping is None:
            raise ValueError("writing the KV cache needs v and slot_mapping")
        if v.shape != k.shape or v.stride(-1) != 1 or slot_mapping.shape != (tokens,):
            raise ValueError(f"v {tuple(v.shape)} / slot_mapping {tuple(slot_mapping.shape)} do not fit "
                             f"k {tuple(k.shape)}")
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:] \
                or not kv_cache.is_contiguous():
            raise ValueError(f"KV cache of shape {tuple(kv_cache.shape)} does not fit keys {tuple(k.shape)}")
        flat = kv_cache.view(2, -1, k.shape[1], head_dim)
        cache_k, cache_v, slots = flat[0], flat[1], slot_mapping
    else:
        v, cache_k, cache_v, slots = k, k, k, cos  # unused placeholders
    if tokens == 0:
        return
    half = head_dim // 2
    on = pdl(q)
    _rotary_kernel[(tokens, num_q_heads + k.shape[1])](
        q, k, v, cos, sin, cache_k, cache_v, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        cache_k.stride(0), cache_k.stride(1) if write else 0,
        num_q_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), WRITE_CACHE=write, PDL=on, **launch_options(on),
    )
