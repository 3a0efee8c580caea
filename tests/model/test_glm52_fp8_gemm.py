"""GLM-5.2's fp8 GEMM path (the ``fp8_gemm`` knob): the quantise / dequantise helpers on the
CPU (weights bit-equal to transformers' ``Fp8Quantize``, activations per 1x128 group within
e4m3's rounding), the checkpoint's fp8 pairs attached to the whole linear layers and equal
to the weights they stand for, and, on a Hopper GPU only, torch's block-scaled fp8
``scaled_mm`` against the same product in float32 and against the dequantised bf16 path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from mstar.config import ConfigError
from mstar.model.glm52.checkpoint import Glm52Checkpoint
from mstar.model.glm52.fp8 import (
    FP8,
    Fp8BlockWeight,
    dequantize_block_fp8,
    dequantize_groups_fp8,
    dequantized,
    fp8_block_linear_emulated,
    quantize_block_fp8,
    quantize_groups_fp8,
    scaled_mm_available,
)
from mstar.model.glm52.knobs import Glm52Knobs
from tests.model.test_glm52_checkpoint import release_config, write_release
from tests.support.glm52 import released_tensors, tiny_reference


def test_weight_quantisation_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=gen) * torch.logspace(-3, 1, 384)
    weight[:128, :128] = 0  # an all-zero block keeps scale 1
    hf = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(128, 128),
                                                                         scale_fmt=None)))
    ref = hf._quantize_one("w.weight", weight)
    q, scale_inv = quantize_block_fp8(weight)
    assert q.dtype == FP8 and scale_inv.shape == (2, 3)
    assert torch.equal(q.view(torch.uint8), ref["w.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, ref["w.weight_scale_inv"])
    back = dequantize_block_fp8(q, scale_inv, (128, 128), torch.float32)
    step = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2**-10  # half e4m3's subnormal step
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + step).all()  # e4m3: 3 mantissa bits


def test_partial_blocks_round_trip() -> None:
    weight = torch.randn(200, 130, generator=torch.Generator().manual_seed(1))
    q, scale_inv = quantize_block_fp8(weight)
    assert scale_inv.shape == (2, 2)
    assert torch.equal(scale_inv[1, 1], 1 / (448 / weight[128:, 128:].abs().max()))
    back = dequantize_block_fp8(q, scale_inv, (128, 128), torch.float32)
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + scale_inv.max() * 2**-10).all()


def test_activation_groups() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 300, generator=gen) * 3
    x[1, 128:256] = 0
    q, scale = quantize_groups_fp8(x)
    assert q.shape == x.shape and q.dtype == FP8 and scale.shape == (5, 3)
    assert torch.equal(scale[0, 2], x[0, 256:].abs().max() / 448) and scale[1, 1] == 1
    assert q.float().abs().amax(dim=-1).eq(448).all()  # each row's largest group hits e4m3's max
    back = dequantize_groups_fp8(q, scale)
    bound = x.abs() * 2**-4 + scale.repeat_interleave(128, dim=-1)[:, :300] * 2**-10  # subnormals
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[1, 128:256], torch.zeros(128))


def test_emulated_product_near_the_dequantised_one() -> None:
    """Quantising the activations per 1x128 group moves the product by e4m3's rounding (a few
    per mille relative here), not more."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(64, 512, generator=gen), torch.randn(256, 512, generator=gen) / 512**0.5
    q, scale_inv = quantize_block_fp8(weight)
    exact = x @ dequantize_block_fp8(q, scale_inv, (128, 128), torch.float32).t()
    emulated = fp8_block_linear_emulated(x, q, scale_inv)
    err = ((emulated - exact).abs().max() / exact.abs().max()).item()
    assert 1e-4 < err < 3e-2, err


def test_fp8_weight_off_hopper_is_the_dequantised_product() -> None:
    gen = torch.Generator().manual_seed(4)
    q, scale_inv = quantize_block_fp8(torch.randn(256, 384, generator=gen))
    weight = Fp8BlockWeight(q, scale_inv)
    assert not weight.fast()
    x, bias = torch.randn(2, 3, 384, generator=gen), torch.randn(256, generator=gen)
    expected = F.linear(x, dequantize_block_fp8(q, scale_inv, (128, 128), torch.float32), bias)
    assert torch.equal(weight.linear(x, bias), expected)


def test_dequantized_hands_pairs_to_keep() -> None:
    q, scale_inv = quantize_block_fp8(torch.randn(128, 128))
    seen = {}
    out = dict(dequantized([("a.weight_scale_inv", scale_inv), ("a.weight", q), ("n.weight", torch.ones(3))],
                           torch.float32, keep=lambda name, w, s: seen.update({name: (w, s)})))
    assert set(out) == {"a.weight", "n.weight"} and set(seen) == {"a.weight"}
    assert seen["a.weight"][0] is q and seen["a.weight"][1] is scale_inv


def test_checkpoint_attaches_pairs_to_whole_linears(tmp_path: Path) -> None:
    """``load_model(fp8_gemm=True)``: the parallel linears whose weight is one stored pair get
    it as ``qweight`` (o_proj, q_b_proj, kv_b_proj, the shared expert's down_proj); each gives
    the product of the parameter it stands beside (off Hopper: the dequantised weight)."""
    ref = tiny_reference(seed=7)
    write_release(tmp_path, released_tensors(ref), release_config(ref))
    model = Glm52Checkpoint.locate(str(tmp_path)).load_model(torch.device("cpu"), torch.float32, dummy=False,
                                                             seed=0, fp8_gemm=True)
    attached = {name: m for name, m in model.named_modules() if getattr(m, "qweight", None) is not None}
    kinds = {name.rsplit(".", 1)[-1] for name in attached}
    assert {"o_proj", "q_b_proj", "kv_b_proj", "down_proj"} <= kinds, kinds
    x = torch.randn(3, 200)
    for name, module in attached.items():
        rows = x[:, :module.weight.shape[1]]
        assert torch.equal(module.qweight.linear(rows), F.linear(rows, module.weight)), name
    plain = Glm52Checkpoint.locate(str(tmp_path)).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    assert not any(getattr(m, "qweight", None) is not None for m in plain.modules())


def test_knob_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="fp8_gemm"):
        Glm52Knobs.parse({"fp8_gemm": True}, device="cpu")
    assert Glm52Knobs.parse({"fp8_gemm": True}, device="cuda").fp8_gemm


@pytest.mark.skipif(not torch.cuda.is_available() or not scaled_mm_available(torch.device("cuda")),
                    reason="block-scaled fp8 scaled_mm needs a Hopper GPU")
@pytest.mark.parametrize("tokens", [1, 3, 64, 200])
def test_scaled_mm_matches_the_emulated_and_the_bf16_products(tokens: int) -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(tokens)
    weight = torch.randn(768, 1024, device=device, generator=gen) / 32
    x = torch.randn(tokens, 1024, device=device, generator=gen).to(torch.bfloat16)
    q, scale_inv = quantize_block_fp8(weight)
    fp8 = Fp8BlockWeight(q, scale_inv)
    assert fp8.fast()
    ours = fp8.linear(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == (tokens, 768)
    emulated = fp8_block_linear_emulated(x.float(), q, scale_inv)
    err = ((ours.float() - emulated).abs().max() / emulated.abs().max()).item()
    assert err <= 1e-2, f"against the float32 product of the same fp8 operands: {err:.2e}"
    bf16 = F.linear(x, dequantize_block_fp8(q, scale_inv, (128, 128), torch.bfloat16)).float()
    err = ((ours.float() - bf16).abs().max() / bf16.abs().max()).item()
    assert err <= 5e-2, f"against the dequantised bf16 path: {err:.2e}"
