"""The fused QK-norm + interleaved RoPE kernel against its torch reference, the reference
against FLUX.2's module path (nn.RMSNorm then apply_rotary_pairs), and the FLUX.2 DiT with the
kernel against the DiT without it.

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (see
tests/support/triton_interpreter.py); when Triton was imported first in this session the
kernel tests skip here and ``test_kernels_in_a_fresh_interpreter`` runs the file again in a
process of its own. The compiled-DiT test needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mstar.layers import triton_qk_norm  # noqa: E402
from mstar.layers.rotary import apply_rotary_pairs  # noqa: E402
from mstar.layers.triton_qk_norm import qk_norm_rope, torch_qk_norm_rope  # noqa: E402
from mstar.model.flux2.config import Flux2TransformerConfig  # noqa: E402
from mstar.model.flux2.rope import rope_cos_sin  # noqa: E402
from mstar.model.flux2.transformer import Flux2Transformer, use_fused_qk_norm_rope  # noqa: E402
from tests.support.markers import needs_cuda
from tests.support.triton_interpreter import (
    DEVICE,
    REASON,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

RUNNABLE = kernels_runnable(triton_qk_norm)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

AXES = (8, 8, 8, 8)  # a 32-wide head, FLUX.2's four rotary axes


def tables(batch: int | None, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (tokens, 4) if batch is None else (batch, tokens, 4)
    ids = torch.randint(0, 64, shape, generator=generator)
    cos, sin = rope_cos_sin(ids, AXES, 2000.0)
    return cos.to(DEVICE), sin.to(DEVICE)


def inputs(batch: int, tokens: int, heads: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, tokens, heads, 32, generator=generator) * 3).to(DEVICE, dtype)
    weight = (torch.rand(32, generator=generator) + 0.5).to(DEVICE, dtype)
    return x, weight


def ulp_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the reference's largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_reference_is_the_module_path():
    """``torch_qk_norm_rope`` rounds where FLUX.2's nn.RMSNorm + apply_rotary_pairs round: equal bits."""
    for dtype in (torch.float32, torch.bfloat16):
        x, weight = inputs(2, 11, 3, dtype)
        norm = torch.nn.RMSNorm(32, eps=1e-6).to(DEVICE, dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        for batch in (None, 2):
            cos, sin = tables(batch, 11)
            with torch.no_grad():
                want = apply_rotary_pairs(norm(x), cos, sin)
                assert torch.equal(torch_qk_norm_rope(x, weight, 1e-6, cos, sin), want)


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, tables_batch", [(1, None), (3, None), (3, 3), (1, 1)])
def test_kernel_matches_reference(dtype, batch, tables_batch):
    x, weight = inputs(batch, 37, 5, dtype)  # 37 x 5 rows: not a multiple of the program's tile
    cos, sin = tables(tables_batch, 37)
    got = qk_norm_rope(x, weight, cos, sin, 1e-6)
    want = torch_qk_norm_rope(x, weight, 1e-6, cos, sin)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    # fp32: only the reduction order differs; bf16: each of the two roundings may go the other
    # way (the interpreter rounds fp32 to bf16 by truncation), 2 ulp of 2**-7 relative
    assert ulp_err(got, want) <= (1e-6 if dtype == torch.float32 else 2e-2)


@runnable
def test_strided_views_are_read_in_place():
    """The single-stream block's q and k are slices of one fused projection's output."""
    generator = torch.Generator().manual_seed(4)
    fused = torch.randn(2, 19, 5 * 4 * 32, generator=generator).to(DEVICE)
    q = fused[..., 4 * 32:2 * 4 * 32].unflatten(-1, (4, 32))  # a view: token stride 640, not 128
    weight = torch.rand(32, generator=generator).to(DEVICE) + 0.5
    cos, sin = tables(2, 19)
    want = torch_qk_norm_rope(q.contiguous(), weight, 1e-5, cos, sin)
    assert ulp_err(qk_norm_rope(q, weight, cos, sin, 1e-5), want) <= 1e-6
    odd = q.transpose(0, 1).contiguous().transpose(0, 1)  # batch and token strides do not merge
    assert ulp_err(qk_norm_rope(odd, weight, cos, sin, 1e-5), want) <= 1e-6


@runnable
def test_bad_tables_are_refused():
    x, weight = inputs(1, 8, 2, torch.float32)
    cos, sin = tables(None, 9)
    with pytest.raises(ValueError, match="rope tables"):
        qk_norm_rope(x, weight, cos, sin, 1e-6)


def tiny_dit() -> Flux2Transformer:
    config = Flux2TransformerConfig(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=32,
                                    num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32,
                                    axes_dims_rope=AXES, guidance_embeds=False)
    torch.manual_seed(0)
    model = Flux2Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def dit_inputs(batch: int = 2):
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 12, 16, generator=generator)
    text = torch.randn(batch, 5, 24, generator=generator)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    img_ids = torch.stack([torch.zeros(12), rows.flatten(), cols.flatten(), torch.zeros(12)], -1).long()
    txt_ids = torch.stack([torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.arange(5)], -1).long()
    return latents, text, torch.tensor([0.9, 0.4][:batch]), img_ids.expand(batch, -1, -1), txt_ids


@runnable
def test_dit_with_the_kernel_matches_the_module_path():
    model = tiny_dit().to(DEVICE)
    args = [t.to(DEVICE) for t in dit_inputs()]
    with torch.no_grad():
        want = model(*args)
        use_fused_qk_norm_rope(model)
        got = model(*args)
        use_fused_qk_norm_rope(model, False)
        assert torch.equal(model(*args), want)  # switched back
    assert ulp_err(got, want) <= 1e-5


@needs_cuda
def test_compiled_bf16_dit_with_the_kernel():
    """No graph break at the custom op; bf16 within a few roundings of the eager module path."""
    model = tiny_dit().to(DEVICE, torch.bfloat16)
    args = [t.to(DEVICE) for t in dit_inputs()]
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    with torch.no_grad():
        want = model(*args)
        use_fused_qk_norm_rope(model)
        compiled = torch.compile(model, fullgraph=True)
        got = compiled(*args)
    assert ulp_err(got, want) <= 3e-2


@pytest.mark.slow  # a whole pytest process of its own
def test_kernels_in_a_fresh_interpreter():
    if RUNNABLE or DEVICE.type == "cuda":
        pytest.skip("the kernels ran in this process")
    rerun_in_fresh_interpreter(__file__, allow_skips=True)  # the compiled-DiT test skips without CUDA
