"""``W8A8Weight`` (mstar.layers.quantized): int8 weights times activations rounded to int8 per
row, int32 sums, on fbgemm.

Against float32: the weight's per-row int8 grid and the activation's per-row int8 grid each
add about 0.5% of a Gaussian row's norm; ``REL`` bounds the product's relative error. The int32
sums are exact (checked at the extreme codes, where a 16-bit intermediate would saturate), and a
row's output does not depend on the other rows of the batch (bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.linear import ColumnParallelLinear
from mstar.layers.quantized import QuantizedLinear, W8A8Weight, w8a8_kernel_available

pytestmark = pytest.mark.skipif(not w8a8_kernel_available(), reason="this torch lacks fbgemm's int8 linear")

REL = 2e-2


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_product_stays_near_float32(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen)
    y = W8A8Weight.quantize(weight).linear(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert rel_error(y, x @ weight.T) < REL


def test_int32_sums_are_exact_at_the_extreme_codes():
    codes = torch.full((16, 512), 127, dtype=torch.int8)
    codes[:8, ::2] = -127
    q = W8A8Weight.from_codes(codes, torch.ones(16))
    x = torch.ones(2, 512)
    x[1, ::2] = -1.0
    sums = codes.float() @ (x * 127).T  # the int32 sums, exact in float32 (below 2**24)
    torch.testing.assert_close(q.linear(x), (sums / 127).T, rtol=0, atol=0)


def test_a_rows_output_does_not_depend_on_the_batch():
    """Per-row activation scales: a row with a large outlier beside it gets the same bits."""
    gen = torch.Generator().manual_seed(0)
    q = W8A8Weight.quantize(torch.randn(64, 128, generator=gen))
    x = torch.randn(6, 128, generator=gen)
    x[3] *= 1000
    batch = q.linear(x)
    for i in range(len(x)):
        assert torch.equal(q.linear(x[i:i + 1])[0], batch[i]), i


def test_leading_dims_dtype_and_bias():
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(64, 32)
    q = QuantizedLinear(W8A8Weight.quantize(layer.weight), layer.bias)
    x = torch.randn(2, 5, 64, generator=gen)
    assert rel_error(q(x), layer(x).detach()) < REL
    y = q.qweight.linear(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 32)
    col = ColumnParallelLinear(64, 32)
    reference = F.linear(x, col.weight, col.bias).detach()
    col.qweight = W8A8Weight.quantize(col.weight)
    assert rel_error(col(x).detach(), reference) < REL
