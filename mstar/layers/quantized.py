"""Weight-only quantised matrices for linear layers on the CPU.

A quantised weight stands in for the float ``[out, in]`` matrix of a linear layer: the layer
keeps its bias and its tensor-parallel logic and calls ``weight.linear(x)`` instead of
``F.linear(x, W)`` (``mstar.layers.linear``; ``mstar.model.quantize`` attaches the weights
from outside, so the modeling files stay the float reference).

* ``Int4Weight``: 4-bit codes in groups of ``group_size`` input features, each group with a
  scale and an offset, ``w = scale * code + offset`` (code in 0..15). This is GGUF's Q4_1
  exactly (Q4_0 too: offset ``-8 * scale``) and the asymmetric int4 of ``quantization: int4``.
  It runs on PyTorch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``), whose packed
  layout and ``(code - 8) * scale + zero`` convention are undone here: ``zero = offset +
  8 * scale``.
* ``Int8Weight``: one int8 code per weight and one scale per output row, ``w = scale *
  code`` (``quantization: int8``), on ``aten._weight_int8pack_mm``.
* ``QuantizedLinear``: a module standing in for a plain ``torch.nn.Linear`` once quantised (a
  model built of ``nn.Linear``, such as Whisper, rather than ``mstar.layers.linear``'s layers):
  its ``qweight`` and bias, nothing else.
* ``W8A8Weight``: int8 weights (one symmetric scale per output row) times int8 activations
  rounded per call with one symmetric scale per row, int32 accumulation, float32 output
  (``quantization: w8a8``; vLLM's and compressed-tensors' name, torchao's
  ``int8_dynamic_activation_int8_weight``), on fbgemm. See its docstring for the choice.
* ``SplitInt8Weight``: GGUF's Q8_0 (int8 codes with a scale per block of 32) exactly, as two
  int4 matrices whose products add: a code ``q`` in -128..127 is ``16 * hi + lo`` with ``lo``
  in 0..15 and ``hi`` in -8..7, so ``d * q = d * lo + 16d * hi``. Two int4 products read as
  many bytes as one int8 one, and PyTorch's int8 kernel takes only a scale per row.
* ``BlockInt4Weight``, ``BlockInt8Weight``: the same int4 and Q8_0 maths with blocks of 32 on
  our own kernel (``mstar.layers.native_cpu``, built on the machine): float32 activations
  and scales, each weight block decoded once for all the rows of a step. ``int4_weight``,
  ``q8_weight`` and ``int8_weight`` (a scale per row: every block of a row the same) pick them
  wherever that kernel loads, PyTorch's kernels otherwise.

Precision (PyTorch's kernels; ours round nothing but the sums' order). Both kernels are
vectorised on x86 for bfloat16 activations only (with float32 ones they are 10-20x slower than
a float32 GEMM on this repository's 2-core AVX-512 test machine), so ``linear`` rounds the
activations to bfloat16, accumulates in float32 inside the kernel and returns the input's
dtype. The scales and zeros are bfloat16 too: a GGUF block scale (float16, 11 significant bits)
loses its last 3 bits. Both errors are well below the 4-bit rounding of the weights themselves;
llama.cpp itself rounds the activations further, to 8-bit blocks (Q8_0/Q8_1) for its integer
dot products. Measured figures: ``tests/layers/test_quantized.py`` and docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.native_cpu import native_kernels

__all__ = ["BlockInt4Weight", "BlockInt8Weight", "Int4Weight", "Int8Weight", "QuantizedLinear", "QuantizedWeight",
           "SplitInt8Weight", "W8A8Weight", "int4_weight", "int8_weight", "q8_weight", "quantized_kernels_available",
           "round_int4", "round_int8", "w8a8_kernel_available"]

INT4_GROUP_SIZE = 32
"""Input features per scale of ``quantization: int4`` (GGUF's block size too)."""

_ACT = torch.bfloat16  # the activation dtype the CPU kernels are vectorised for


def quantized_kernels_available() -> bool:
    """Whether this torch has the int4 and int8 weight-only CPU kernels."""
    ops = torch.ops.aten
    return all(hasattr(ops, name) for name in
               ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm"))


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """A kernel's bfloat16 rows ``y`` as ``x``'s dtype and leading shape, plus ``bias``."""
    y = y.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


@dataclass
class Int4Weight:
    """``w[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` with ``g = k // group_size``.

    ``packed``: uint8 ``[out, in / 2]`` in the layout of
    ``aten._convert_weight_to_int4pack_for_cpu``; ``scales_zeros``: bfloat16
    ``[in / group_size, out, 2]`` (the kernel's ``scale`` and ``zero``)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    out_features: int
    in_features: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4Weight:
        """From codes ``[out, in]`` (integers 0..15) and per-group ``scale`` and ``offset``
        ``[out, in / group_size]``."""
        out_features, in_features = codes.shape
        groups = scale.shape[1]
        if in_features % groups or scale.shape != offset.shape or scale.shape[0] != out_features:
            raise ValueError(f"codes {tuple(codes.shape)} do not split into groups of scale {tuple(scale.shape)} "
                             f"and offset {tuple(offset.shape)}")
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("int4 codes must lie in 0..15")
        group_size = in_features // groups
        if group_size % 2 or in_features % 16:
            raise ValueError(f"int4 weights need an even group size and in_features divisible by 16, "
                             f"got group {group_size}, in_features {in_features}")
        scale, zero = scale.float(), offset.float() + 8 * scale.float()  # the kernel: (code - 8) * scale + zero
        pad = -out_features % 16  # the kernel packs rows by 16: zero rows fill the last pack
        codes, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (codes.to(torch.int32), scale, zero))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(_ACT)
        return cls(packed, scales_zeros, group_size, out_features, in_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
        """Round a float ``[out, in]`` matrix to 4 bits per weight (``round_int4``)."""
        return cls.from_codes(*round_int4(weight, group_size))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T + bias`` for ``x [..., in]`` (the product in bfloat16, returned in
        ``x``'s dtype)."""
        rows = x.reshape(-1, self.in_features).to(_ACT)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_zeros)
        if y.shape[-1] != self.out_features:  # rows padded to a multiple of 16
            y = y[:, :self.out_features]
        return _finish(y, x, bias, self.out_features)


def round_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """``(codes, scale, offset)`` of a float ``[out, in]`` matrix rounded to 4 bits per weight:
    per group of ``group_size`` inputs the range ``[min, max]`` in 15 equal steps
    (``quantization: int4``)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(out_features, -1, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.reshape(out_features, in_features), scale, low


_TILE = 16  # output rows per tile of the native kernel's layout (csrc/block_gemm.cpp)
_BLOCK = 32  # input features per scale there


def _tiled(t: torch.Tensor) -> torch.Tensor:
    """``[out, C]`` as the native layout's ``[out / 16, C, 16]`` (rows padded with zeros)."""
    t = F.pad(t, (0, 0, 0, -t.shape[0] % _TILE))
    return t.reshape(-1, _TILE, t.shape[1]).transpose(1, 2).contiguous()


def _native(in_features: int, blocks: int) -> bool:
    """Whether a matrix of ``blocks`` scales per row goes to the native kernel: blocks of 32
    inputs, and the kernel loaded."""
    return in_features == _BLOCK * blocks and native_kernels()


def _check_blocks(codes: torch.Tensor, scale: torch.Tensor) -> None:
    if codes.shape[1] != _BLOCK * scale.shape[1] or codes.shape[0] != scale.shape[0]:
        raise ValueError(f"codes {tuple(codes.shape)} are not in blocks of {_BLOCK} under scale {tuple(scale.shape)}")


@dataclass
class BlockInt4Weight:
    """``w[n, k] = scale[n, g] * code[n, k] + offset[n, g]``, ``g = k // 32`` (Q4_0, Q4_1,
    ``quantization: int4``) on the native kernel: ``codes`` uint8 ``[out / 16, in / 2, 16]``
    (two inputs' codes a byte), ``scales`` and ``offsets`` float32 ``[out / 16, in / 32, 16]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> BlockInt4Weight:
        """From codes ``[out, in]`` (0..15) and ``scale``, ``offset`` ``[out, in / 32]``."""
        _check_blocks(codes, scale)
        if scale.shape != offset.shape:
            raise ValueError(f"scale {tuple(scale.shape)} and offset {tuple(offset.shape)} differ")
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("int4 codes must lie in 0..15")
        pairs = _tiled(codes.to(torch.uint8))  # [tiles, in, 16]
        packed = pairs[:, 0::2] | (pairs[:, 1::2] << 4)
        return cls(packed.contiguous(), _tiled(scale.float()), _tiled(offset.float()), *codes.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T + bias`` for ``x [..., in]`` (float32 inside, returned in ``x``'s dtype)."""
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mstar_cpu.int4_block_mm(rows, self.codes, self.scales, self.offsets, self.out_features)
        return _finish(y, x, bias, self.out_features)


@dataclass
class BlockInt8Weight:
    """``w[n, k] = scale[n, k // 32] * code[n, k]`` (GGUF's Q8_0) on the native kernel:
    ``codes`` int8 ``[out / 16, in, 16]``, ``scales`` float32 ``[out / 16, in / 32, 16]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor) -> BlockInt8Weight:
        """From int8 ``codes [out, in]`` and ``scale [out, in / 32]``."""
        _check_blocks(codes, scale)
        return cls(_tiled(codes.to(torch.int8)), _tiled(scale.float()), *codes.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mstar_cpu.int8_block_mm(rows, self.codes, self.scales, self.out_features)
        return _finish(y, x, bias, self.out_features)


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> QuantizedWeight:
    """The int4 matrix of ``codes``, ``scale``, ``offset`` (see ``Int4Weight.from_codes``) on
    the native kernel where it loads and the blocks are 32 wide, else on PyTorch's."""
    if _native(codes.shape[1], scale.shape[1]):
        return BlockInt4Weight.from_codes(codes, scale, offset)
    return Int4Weight.from_codes(codes, scale, offset)


def round_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: a float ``[out, in]`` matrix rounded to int8 codes (-127..127) with
    one symmetric float32 scale per row (``quantization: int8``)."""
    w = weight.detach().float()
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale


def int8_weight(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` rounded by ``round_int8``, on the native kernel where it loads (the row's
    scale repeated for each block of 32: the same maths, in float32; ~30% faster than
    PyTorch's int8 kernel at Whisper base's one-row shapes), else as ``Int8Weight``."""
    if not _native(weight.shape[1], weight.shape[1] // _BLOCK):
        return Int8Weight.quantize(weight)
    codes, scale = round_int8(weight)
    return BlockInt8Weight.from_codes(codes, scale[:, None].expand(-1, weight.shape[1] // _BLOCK))


def q8_weight(codes: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """GGUF's Q8_0 (int8 ``codes`` with a ``scale`` per block) on the native kernel where it
    loads and the blocks are 32 wide, else as ``SplitInt8Weight``."""
    if _native(codes.shape[1], scale.shape[1]):
        return BlockInt8Weight.from_codes(codes, scale)
    return SplitInt8Weight.from_codes(codes, scale)


@dataclass
class Int8Weight:
    """``w[n, k] = scale[n] * code[n, k]``: int8 ``codes [out, in]``, bfloat16 ``scales [out]``."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Round a float ``[out, in]`` matrix to int8 with one symmetric scale per row
        (``round_int8``)."""
        codes, scale = round_int8(weight)
        return cls(codes, scale.to(_ACT))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(_ACT)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        return _finish(y, x, bias, self.out_features)


@dataclass
class SplitInt8Weight:
    """Int8 codes with a scale per block (GGUF's Q8_0, ``w = scale * code``) as the sum of two
    ``Int4Weight``: the low and the high nibble of each code."""

    low: Int4Weight
    high: Int4Weight

    @property
    def out_features(self) -> int:
        return self.low.out_features

    @property
    def in_features(self) -> int:
        return self.low.in_features

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor) -> SplitInt8Weight:
        """From int8 ``codes [out, in]`` and per-block ``scale [out, in / block]``."""
        q = codes.to(torch.int32)
        low, high = q & 15, q >> 4  # q = 16 * high + low, high in -8..7 (arithmetic shift)
        scale = scale.float()
        return cls(Int4Weight.from_codes(low, scale, torch.zeros_like(scale)),
                   Int4Weight.from_codes(high + 8, 16 * scale, -8 * 16 * scale))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.low.linear(x, bias)
        return y.add_(self.high.linear(x))


_X_ZERO = 128  # fbgemm's activations are uint8: a row's codes -127..127 sit at 1..255


def w8a8_kernel_available() -> bool:
    """Whether this torch has fbgemm's int8 x int8 linear (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def _fbgemm_pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed form of int8 ``codes [out, in]`` with float ``scales [out]``. The one
    place that builds a quantised tensor (``torch.quantize_per_channel`` and the packing op
    print a deprecation warning in torch 2.13: ``torch.ao.quantization`` is moving to torchao)."""
    zeros = torch.zeros_like(scales, dtype=torch.long)
    qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(qweight, None)


@dataclass
class W8A8Weight:
    """``w[n, k] = scale[n] * code[n, k]`` (int8 codes, a symmetric float32 scale per output
    row) multiplied by activations rounded to int8 at every call, one symmetric scale per row
    of ``x``: ``y[m, n] = sx[m] * scale[n] * sum_k xcode[m, k] * code[n, k]``, the sum in int32.

    One scale per activation row keeps a row's output independent of the other rows of the
    batch (a per-tensor scale, as ``torch.ops.quantized.linear_dynamic`` takes, would make a
    request's tokens depend on who shares its step). fbgemm takes a per-tensor activation scale
    only, so ``linear`` rounds the rows itself and hands fbgemm integers with scale 1 (its own
    rounding of them is exact) and multiplies the output rows by ``sx`` after.

    Kernel choice, measured on the 2-core AVX-512 VNNI test machine (torch 2.13, 2 threads,
    SmolLM2-135M's gate_up 576 -> 3072, us per product at 1 / 8 / 16 rows, min of 7 reps on a
    shared, noisy machine): fbgemm with per-row rounding 52 / 83 / 124; fbgemm's own dynamic
    per-tensor linear 30 / 57 / 93; the int4 weight-only kernel 68-104 / 183-480 / 356; oneDNN's
    ``qlinear_pointwise`` 45 / 73 when its weight is packed for that exact row count, but 3.6 ms
    to 150 ms for other row counts or int8 (rather than uint8) activations; ``torch._int_mm`` 128
    at 8 rows (the lead's figure)."""

    packed: torch.ScriptObject
    out_features: int
    in_features: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> W8A8Weight:
        """From int8 ``codes [out, in]`` (-127..127) and float ``scales [out]``."""
        return cls(_fbgemm_pack(codes.contiguous(), scales.float()), *codes.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> W8A8Weight:
        """Round a float ``[out, in]`` matrix to int8 with one symmetric scale per row."""
        w = weight.detach().float()
        scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        return cls.from_codes((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T + bias`` for ``x [..., in]`` (returned in ``x``'s dtype)."""
        rows = x.reshape(-1, self.in_features).float()
        sx = (rows.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (rows / sx).round_()  # integers in -127..127, as floats: fbgemm rounds them exactly
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(codes, 1.0, _X_ZERO, self.packed)
        return _finish(y.mul_(sx), x, bias, self.out_features)


QuantizedWeight = Int4Weight | Int8Weight | SplitInt8Weight | W8A8Weight | BlockInt4Weight | BlockInt8Weight


class QuantizedLinear(nn.Module):
    """``x @ w.T + bias`` with a quantised ``w``: what ``mstar.model.quantize`` puts in place of
    a plain ``nn.Linear`` (the float weight is not kept)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = qweight
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qweight.linear(x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, qweight={type(self.qweight).__name__}")
