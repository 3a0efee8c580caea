"""Weight-only quantised matrices (mstar.layers.quantized) against the float matrices they
stand for, and the parallel linears taking them (``qweight``).

The kernels run in bfloat16 (see the module's docstring): a product's relative error against
float32 is about 3e-3 (bfloat16 activations, scales and output); ``REL`` bounds it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mstar.layers.quantized import Int4Weight, Int8Weight, SplitInt8Weight, quantized_kernels_available

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="this torch lacks the int4/int8 CPU kernels")

REL = 1e-2


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def blocks(out: int, cols: int, group: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=gen)
    scale = torch.rand(out, cols // group, generator=gen) * 0.02 + 0.001
    offset = -8 * scale + torch.randn(out, cols // group, generator=gen) * 0.01
    weight = (codes.float().unflatten(1, (-1, group)) * scale[..., None] + offset[..., None]).flatten(1)
    return codes, scale, offset, weight


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_codes_multiply_as_scale_times_code_plus_offset(rows):
    codes, scale, offset, weight = blocks(96, 128)
    x = torch.randn(rows, 128)
    y = Int4Weight.from_codes(codes, scale, offset).linear(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert rel_error(y, x @ weight.T) < REL


def test_int4_group_size_follows_the_scales():
    codes, scale, offset, weight = blocks(64, 256, group=64)
    q = Int4Weight.from_codes(codes, scale, offset)
    x = torch.randn(2, 256)
    assert q.group_size == 64 and rel_error(q.linear(x), x @ weight.T) < REL


def test_int4_refuses_codes_outside_four_bits():
    codes, scale, offset, _ = blocks(32, 64)
    with pytest.raises(ValueError, match="0..15"):
        Int4Weight.from_codes(codes + 1, scale, offset)


def test_split_int8_is_exact_in_its_codes():
    """Q8_0: int8 codes with a scale per 32; the low and high nibbles multiply to the same."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (80, 64), generator=gen, dtype=torch.int8)
    codes[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)  # the extremes and the sign edge
    scale = torch.rand(80, 2, generator=gen) * 0.01
    weight = (codes.float().unflatten(1, (-1, 32)) * scale[..., None]).flatten(1)
    x = torch.randn(4, 64)
    assert rel_error(SplitInt8Weight.from_codes(codes, scale).linear(x), x @ weight.T) < REL


@pytest.mark.parametrize("kind, bound", [(Int4Weight, 0.1), (Int8Weight, 0.01)])
def test_rounding_a_float_matrix(kind, bound):
    """int4 keeps 15 steps per group of 32 (about 5% of a Gaussian row's norm), int8 127 per row."""
    weight = torch.randn(64, 128)
    x = torch.randn(5, 128)
    assert rel_error(kind.quantize(weight).linear(x), x @ weight.T) < bound


def test_layers_take_a_quantised_weight_and_keep_their_bias():
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    for layer in (ColumnParallelLinear(64, 32), RowParallelLinear(64, 32), QKVParallelLinear(64, 16, 2, 1)):
        reference = F.linear(x, layer.weight, layer.bias)
        layer.qweight = Int8Weight.quantize(layer.weight.detach())
        layer.weight.data = torch.empty(0)  # the product must not read it
        assert rel_error(layer(x), reference) < REL


def test_tied_logits_use_the_quantised_copy_and_lookups_the_float_rows():
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(100, 64)  # 100 rows: the kernel packs 16, so 4 are padding
    hidden, ids = torch.randn(2, 64), torch.tensor([3, 99])
    reference = emb.logits(hidden)
    emb.qweight = Int4Weight.quantize(emb.weight.detach())
    assert rel_error(emb.logits(hidden), reference) < 0.1
    assert torch.equal(emb(ids), emb.weight[ids])
