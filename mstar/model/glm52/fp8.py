"""GLM-5.2-FP8's block-scaled weights (DeepSeek-V3's fine-grained fp8 scheme).

The release stores most matrices ``W [R, C]`` as ``float8_e4m3fn`` with a ``weight_scale_inv
[ceil(R / 128), ceil(C / 128)]`` (float32) beside each: the real weight is
``W[i, j] * scale_inv[i // 128, j // 128]`` (the block is ``quantization_config.weight_block_size``;
the last block of a row or column may be partial, e.g. ``kv_a_proj_with_mqa``'s 576 rows). Norms,
embeddings, the router and the head are stored unquantised.

The CPU path dequantises each weight once while loading (``dequantized``): the product in
float32, then one rounding to the model's dtype, as transformers' ``Fp8Dequantize`` does.

The fp8 GEMM path (the ``fp8_gemm`` knob, Hopper): ``dequantized`` also hands each 2-D pair to
a ``keep`` callback, and ``attach_fp8_gemms`` sets an ``Fp8BlockWeight`` as the ``qweight`` of
every parallel linear whose whole weight is such a pair (a layer split by TP, or fused from
several checkpoint tensors, keeps its bf16 product). ``Fp8BlockWeight.linear`` quantises the
activations per token and per group of 128 input features (``quantize_groups_fp8``: a scale
of ``amax / 448`` per group, DeepSeek-V3's dynamic scheme) and runs ``torch``'s block-scaled
``scaled_mm`` (1x128 activation scales, 128x128 weight scales; SM90, both dimensions of the
weight multiples of 128); anywhere else it multiplies by the dequantised weight.
``fp8_block_linear_emulated`` is that product in float32 from the same quantised operands
(the CUDA test's reference). The bf16 weights stay loaded beside the fp8 ones for now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.weights import WeightLoadError

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
DEFAULT_BLOCK = (128, 128)
ACT_GROUP = 128  # input features per activation scale
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


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
                block: tuple[int, int] = DEFAULT_BLOCK,
                keep: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None,
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(name, tensor)`` with every fp8 weight and its ``weight_scale_inv``
    merged into one dequantised ``weight`` in ``dtype`` (in whatever order the pair comes);
    other tensors pass through. ``keep(name, weight, scale_inv)``, when given, also sees each
    pair as stored (the fp8 GEMM path). An fp8 weight without its scale, or a scale without
    its weight, fails naming them."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def merged(base: str, weight: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor]:
        if keep is not None:
            keep(base, weight, scale)
        return base, dequantize_block_fp8(weight, scale, block, dtype)

    for name, tensor in tensors:
        if name.endswith(".weight" + SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights:
                yield merged(base, weights.pop(base), tensor)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield merged(name, tensor, scales.pop(name))
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lost = [f"{n} (no {n}{SCALE_SUFFIX})" for n in weights] + [f"{n}{SCALE_SUFFIX} (no {n})" for n in scales]
        raise WeightLoadError(f"fp8 weights and scales that do not pair up: {', '.join(sorted(lost)[:8])}")


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_fp8 [R, C], scale_inv [ceil(R / bm), ceil(C / bn)])`` of a float ``weight [R, C]``:
    each block multiplied by ``448 / amax`` (an all-zero block by 1), clamped, rounded to e4m3,
    and ``scale_inv`` that factor's reciprocal (transformers' ``Fp8Quantize`` arithmetic, to the
    bit); ``dequantize_block_fp8`` undoes it up to e4m3's rounding. Partial last blocks allowed."""
    rows, cols = weight.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    padded = F.pad(weight.float(), (0, grid[1] * bn - cols, 0, grid[0] * bm - rows))
    tiles = padded.reshape(grid[0], bm, grid[1], bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    q = (tiles * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), 1.0 / scale


def quantize_groups_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [..., K], scale [..., ceil(K / group)])`` of activations ``x [..., K]``: each
    row's groups of ``group`` features divided by their ``amax / 448`` (float32; an all-zero
    group by 1) and rounded to e4m3. ``x_fp8 * scale`` (per group) restores ``x``."""
    k = x.shape[-1]
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).reshape(*x.shape[:-1], groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*x.shape[:-1], groups * group)[..., :k].contiguous(), scale


def dequantize_groups_fp8(q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """``quantize_groups_fp8``'s inverse: ``q [..., K]`` times its group scales, float32."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]


def fp8_block_linear_emulated(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                              block: tuple[int, int] = DEFAULT_BLOCK, group: int = ACT_GROUP) -> torch.Tensor:
    """The product an fp8 GEMM computes, in float32: ``x [T, K]`` quantised per 1 x ``group``,
    times the block-scaled ``weight [N, K]``, both dequantised exactly; ``[T, N]`` float32."""
    q, scale = quantize_groups_fp8(x, group)
    return dequantize_groups_fp8(q, scale, group) @ dequantize_block_fp8(weight, scale_inv, block,
                                                                         torch.float32).t()


def scaled_mm_available(device: torch.device) -> bool:
    """Whether ``device`` runs torch's block-scaled fp8 ``scaled_mm`` (1x128 x 128x128 scales:
    Hopper, SM90)."""
    return (device.type == "cuda" and hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(device) == (9, 0))


@dataclass
class Fp8BlockWeight:
    """A linear layer's ``[N, K]`` weight kept as the checkpoint stores it: e4m3 ``weight`` and
    float32 ``scale_inv [ceil(N / bm), ceil(K / bn)]`` (``module.qweight``; see the module
    docstring for ``linear``)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = DEFAULT_BLOCK
    _dequantized: torch.Tensor | None = field(default=None, repr=False)
    _scale_b: torch.Tensor | None = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def fast(self) -> bool:
        """Whether ``linear`` runs the fp8 GEMM (else the dequantised product)."""
        n, k = self.weight.shape
        return (tuple(self.block) == (128, 128) and n % 128 == 0 and k % 128 == 0
                and scaled_mm_available(self.weight.device))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fast():
            return F.linear(x, self.dequantized(x.dtype), bias)
        y = self.scaled_mm(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.dtype != dtype:
            self._dequantized = dequantize_block_fp8(self.weight, self.scale_inv, self.block, dtype)
        return self._dequantized

    def scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T, K]`` times the weight on torch's block-scaled fp8 GEMM, in ``rows``' dtype.
        The activations' scales go outer-dim-major (``[T, K / 128]`` with stride ``(1, T)``), the
        weight's as the kernel reads 128x128 scales (groups of K padded to a multiple of 4,
        then transposed). Rows are padded to a multiple of 4: on an H100 one row failed the GPU
        test (64 and 200 rows passed), presumably because the outer-dim-major scales of a row
        count that is not a multiple of 4 are not 16-byte aligned; not yet rerun on a GPU."""
        count = rows.shape[0]
        if count % 4:  # the activation scales' columns are read 16 bytes at a time
            rows = F.pad(rows, (0, 0, 0, -count % 4))
        q, scale = quantize_groups_fp8(rows, ACT_GROUP)
        scale_a = scale.t().contiguous().t()
        if self._scale_b is None:
            groups = self.scale_inv.shape[1]
            padded = F.pad(self.scale_inv.float(), (0, -groups % 4), value=1.0)
            self._scale_b = padded.t()  # [K / 128 padded, N / 128], a transposed view
        out = F.scaled_mm(q, self.weight.t(), scale_a, F.ScalingType.BlockWise1x128, self._scale_b,
                          F.ScalingType.BlockWise128x128, output_dtype=rows.dtype)
        return out[:count]


def attach_fp8_gemms(model: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     block: tuple[int, int] = DEFAULT_BLOCK) -> list[str]:
    """Set ``Fp8BlockWeight(pairs[name + ".weight"])`` as the ``qweight`` of every module of
    ``model`` that has one and whose whole weight that pair is (same shape); returns their
    names. The pairs move to the module's device."""
    attached = []
    for name, module in model.named_modules():
        pair = pairs.get(f"{name}.weight")
        if pair is None or not hasattr(module, "qweight") or not isinstance(module.weight, torch.Tensor):
            continue
        weight, scale_inv = pair
        if tuple(weight.shape) != tuple(module.weight.shape):
            continue  # split by TP, or a different layout: the bf16 product stays
        device = module.weight.device
        module.qweight = Fp8BlockWeight(weight.to(device), scale_inv.to(device, torch.float32), tuple(block))
        attached.append(name)
    log.info("fp8 GEMMs on %d linear layers", len(attached))
    return attached
