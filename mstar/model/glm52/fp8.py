"""GLM-5.2-FP8's block-scaled weights (DeepSeek-V3's fine-grained fp8 scheme).

The release stores most matrices ``W [R, C]`` as ``float8_e4m3fn`` with a ``weight_scale_inv
[ceil(R / 128), ceil(C / 128)]`` (float32) beside each: the real weight is
``W[i, j] * scale_inv[i // 128, j // 128]`` (the block is ``quantization_config.weight_block_size``;
the last block of a row or column may be partial, e.g. ``kv_a_proj_with_mqa``'s 576 rows). Norms,
embeddings, the router and the head are stored unquantised.

The CPU path (and, for now, every path) dequantises each weight once while loading
(``dequantized``): the product in float32, then one rounding to the model's dtype, as
transformers' ``Fp8Dequantize`` does. The hook for fp8 GEMMs on Hopper is the parallel linears'
``qweight`` (``mstar.layers.linear``: a ``QuantizedWeight`` whose ``linear(x, bias)`` runs the
layer): an ``e4m3`` weight with its block scales and a block-scaled fp8 GEMM kernel there, and
``dequantized`` passing the pair through instead of multiplying it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from mstar.model.weights import WeightLoadError

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
DEFAULT_BLOCK = (128, 128)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight [..., R, C]`` (fp8) times its per-block ``scale_inv [..., ceil(R / bm), ceil(C / bn)]``,
    computed in float32 and returned in ``dtype``."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(f"weight of shape {tuple(weight.shape)} in {bm}x{bn} blocks needs a scale grid {grid}, "
                         f"got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                block: tuple[int, int] = DEFAULT_BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(name, tensor)`` with every fp8 weight and its ``weight_scale_inv``
    merged into one dequantised ``weight`` in ``dtype`` (in whatever order the pair comes);
    other tensors pass through. An fp8 weight without its scale, or a scale without its
    weight, fails naming them."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(".weight" + SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights:
                yield base, dequantize_block_fp8(weights.pop(base), tensor, block, dtype)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize_block_fp8(tensor, scales.pop(name), block, dtype)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lost = [f"{n} (no {n}{SCALE_SUFFIX})" for n in weights] + [f"{n}{SCALE_SUFFIX} (no {n})" for n in scales]
        raise WeightLoadError(f"fp8 weights and scales that do not pair up: {', '.join(sorted(lost)[:8])}")
