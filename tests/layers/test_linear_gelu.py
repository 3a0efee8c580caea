"""``mstar::linear_gelu_tanh``: the product with its bias and tanh GELU as one op.

On the CPU it is the two-pass path, so the CPU tests check what the op adds there: it traces
under ``torch.compile`` (the fake's shape) and a compiled call equals the eager one. On CUDA it
is cuBLASLt's GELU epilogue, which rounds once where the two-pass path rounds twice: within two
bf16 steps of the two-pass result, eager and compiled, and exact in float32 to 1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.mlp import linear_gelu_tanh


def two_pass(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def operands(device, dtype, rows=37, k=64, n=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, rows, k, generator=g)
    weight = torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g)
    return tuple(t.to(device, dtype) for t in (x, weight, bias))


def test_on_the_cpu_it_is_the_two_pass_path_and_compiles():
    x, weight, bias = operands("cpu", torch.float32)
    eager = linear_gelu_tanh(x, weight, bias)
    assert eager.shape == (2, 37, 96)
    torch.testing.assert_close(eager, two_pass(x, weight, bias), rtol=0, atol=0)
    compiled = torch.compile(lambda *a: linear_gelu_tanh(*a) * 2, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x, weight, bias), eager * 2, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLASLt epilogue needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_epilogue_equals_the_two_pass_path(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    x, weight, bias = operands("cuda", dtype, rows=1000, k=256, n=512)
    reference = two_pass(x.float(), weight.float(), bias.float())
    fused = linear_gelu_tanh(x, weight, bias).float()
    compiled = torch.compile(linear_gelu_tanh, fullgraph=True)(x, weight, bias).float()
    if dtype == torch.float32:
        tolerance = dict(rtol=1e-5, atol=1e-5)
    else:  # the reference in float32: each bf16 path within two of its steps at the value
        tolerance = dict(rtol=2 * 2**-8, atol=2e-2)
        torch.testing.assert_close(two_pass(x, weight, bias).float(), reference, **tolerance)
    torch.testing.assert_close(fused, reference, **tolerance)
    torch.testing.assert_close(compiled, fused, rtol=0, atol=0)
