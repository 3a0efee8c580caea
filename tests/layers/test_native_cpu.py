"""Our own block-quantised CPU kernels (``mstar/layers/csrc/block_gemm.cpp`` through
``mstar.layers.native_cpu``) against the float products they stand for.

They keep float32 activations and scales, so a product differs from the float32 matrix
product of the decoded weights only by the order of its sums (~1e-6 relative), and a row's
result is the same bits whatever rows share its call."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from mstar.layers.native_cpu import native_kernels
from mstar.layers.quantized import (
    BlockInt4Weight,
    BlockInt8Weight,
    Int4Weight,
    SplitInt8Weight,
    int4_weight,
    q8_weight,
)

# where they can be built they must be: a failed build would otherwise only show as a slow server
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("c++") is None
                                or os.environ.get("MSTAR_NATIVE_KERNELS") == "0",
                                reason="the native CPU kernels are built on Linux with a C++ compiler")


def test_the_kernels_build_and_load():
    assert native_kernels()

REL = 1e-5


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def q4(out: int, cols: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=gen)
    codes[0, :3] = torch.tensor([0, 15, 7])
    scale = torch.rand(out, cols // 32, generator=gen) * 0.02 + 0.001
    offset = -8 * scale + torch.randn(out, cols // 32, generator=gen) * 0.01
    weight = (codes.double().unflatten(1, (-1, 32)) * scale[..., None] + offset[..., None]).flatten(1)
    return codes, scale, offset, weight


def q8(out: int, cols: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out, cols), generator=gen, dtype=torch.int8)
    codes[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    scale = torch.rand(out, cols // 32, generator=gen) * 0.01
    weight = (codes.double().unflatten(1, (-1, 32)) * scale[..., None]).flatten(1)
    return codes, scale, weight


@pytest.mark.parametrize("out", [16, 100, 333])  # whole tiles, a part tile, more tiles than threads' share
@pytest.mark.parametrize("rows", [1, 5, 8, 19])  # one register chunk, part, whole, several
def test_int4_blocks_multiply_as_scale_times_code_plus_offset(out, rows):
    codes, scale, offset, weight = q4(out, 96)
    x = torch.randn(rows, 96)
    q = BlockInt4Weight.from_codes(codes, scale, offset)
    y = q.linear(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out) and y.is_contiguous()
    assert rel_error(y, x.double() @ weight.T) < REL


@pytest.mark.parametrize("out", [16, 70])
@pytest.mark.parametrize("rows", [1, 8, 11])
def test_q8_blocks_are_exact_in_their_codes(out, rows):
    codes, scale, weight = q8(out, 64)
    x = torch.randn(rows, 64)
    y = BlockInt8Weight.from_codes(codes, scale).linear(x)
    assert y.shape == (rows, out) and rel_error(y, x.double() @ weight.T) < REL


def test_a_rows_result_does_not_depend_on_its_batch():
    """A request's tokens must not change with who shares its step: each row, computed alone,
    equals its row of the batch bit for bit."""
    codes, scale, offset, _ = q4(48, 64)
    w4 = BlockInt4Weight.from_codes(codes, scale, offset)
    c8, s8, _ = q8(48, 64)
    w8 = BlockInt8Weight.from_codes(c8, s8)
    x = torch.randn(13, 64)
    for w in (w4, w8):
        batch = w.linear(x)
        for i in range(x.shape[0]):
            assert torch.equal(w.linear(x[i:i + 1]), batch[i:i + 1])


def test_leading_dims_bias_and_dtype_follow_the_input():
    codes, scale, offset, weight = q4(32, 64)
    bias = torch.randn(32, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = BlockInt4Weight.from_codes(codes, scale, offset).linear(x, bias)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    assert rel_error(y, x.double() @ weight.T + bias.double()) < 1e-2


def test_the_builders_pick_the_native_kernel_for_blocks_of_32_only():
    codes, scale, offset, _ = q4(32, 128)
    assert isinstance(int4_weight(codes, scale, offset), BlockInt4Weight)
    wide = int4_weight(codes, scale[:, ::2].contiguous(), offset[:, ::2].contiguous())  # groups of 64
    assert isinstance(wide, Int4Weight) and wide.group_size == 64
    c8, s8, _ = q8(32, 64)
    assert isinstance(q8_weight(c8, s8), BlockInt8Weight)


def test_bad_codes_are_refused():
    codes, scale, offset, _ = q4(32, 64)
    with pytest.raises(ValueError, match="0..15"):
        BlockInt4Weight.from_codes(codes + 1, scale, offset)
    with pytest.raises(ValueError, match="blocks of 32"):
        BlockInt4Weight.from_codes(codes[:, :48], scale, offset)


def test_switched_off_the_builders_fall_back_to_torchs_kernels(tmp_path):
    """``MSTAR_NATIVE_KERNELS=0`` (or no compiler) gives PyTorch's kernels, same maths."""
    script = (
        "import torch\n"
        "from mstar.layers.quantized import int4_weight, q8_weight\n"
        "c = torch.randint(0, 16, (32, 64)); s = torch.rand(32, 2) * 0.01\n"
        "print(type(int4_weight(c, s, -8 * s)).__name__, type(q8_weight(c.to(torch.int8), s)).__name__)\n"
    )
    env = dict(os.environ, MSTAR_NATIVE_KERNELS="0", MSTAR_KERNEL_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Int4Weight", "SplitInt8Weight"]
    assert not any(tmp_path.iterdir())  # nothing built


def test_native_and_torchs_kernels_agree_to_bfloat16_rounding():
    codes, scale, offset, _ = q4(64, 128)
    x = torch.randn(4, 128)
    ours = BlockInt4Weight.from_codes(codes, scale, offset).linear(x)
    torchs = Int4Weight.from_codes(codes, scale, offset).linear(x)
    assert rel_error(ours, torchs.double()) < 1e-2
    c8, s8, _ = q8(64, 128)
    split = SplitInt8Weight.from_codes(c8, s8).linear(x).double()
    assert rel_error(BlockInt8Weight.from_codes(c8, s8).linear(x), split) < 1e-2
