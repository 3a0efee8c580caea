"""The fused Triton kernels (residual add + RMSNorm, SiLU * up, RoPE in place) against their
torch references, and the Llama decoder with ``fused_kernels`` on against eager torch.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET``
is set before ``mstar.layers.triton_fused`` is first imported (as in test_triton_attention.py).
When something else imported Triton first in this session, the kernel tests skip here and
``test_kernels_in_a_fresh_interpreter`` runs this file again in a process of its own, so they
never silently go unrun. The GPU tests (bf16 model, CUDA-graph capture) skip without CUDA.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_cuda_graphs import decode_graphs, step_meta  # noqa: E402
from test_cuda_graphs import tiny_llama as gpu_llama

from mstar.config import ConfigError, DeploymentConfig  # noqa: E402
from mstar.engine.page_pool import PagePool  # noqa: E402
from mstar.layers import triton_fused  # noqa: E402
from mstar.layers.paged_kv import allocate_kv_cache, write_kv_cache  # noqa: E402
from mstar.layers.rotary import RotaryEmbedding  # noqa: E402
from mstar.layers.triton_fused import (  # noqa: E402
    add_rmsnorm,
    rotary_,
    silu_and_mul,
    torch_add_rmsnorm,
    torch_rotary,
    torch_silu_and_mul,
)
from mstar.model.decode_engines import decode_engine  # noqa: E402
from mstar.model.knobs import DecodeKnobs  # noqa: E402
from mstar.model.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from tests.support.markers import needs_cuda
from tests.support.triton_interpreter import (
    DEVICE,
    REASON,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

RUNNABLE = kernels_runnable(triton_fused)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

# Max error relative to the reference's largest magnitude. fp32: only the reduction order and
# rsqrt/exp differ. bf16: the interpreter rounds fp32 to bf16 by truncation (one ulp, 2**-7).
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.slow  # a whole pytest process of its own
@pytest.mark.skipif(RUNNABLE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter() -> None:
    rerun_in_fresh_interpreter(__file__, allow_skips=True)


# ---------------------------------------------------------------------------- kernels
@runnable
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_matches_torch(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of two: the row block is masked
    x = (3 * torch.randn(2, 3, hidden, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.empty(hidden).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    kept = None if residual is None else residual.clone()
    ref, ref_sum = torch_add_rmsnorm(x, residual, weight, 1e-5)
    out, summed = add_rmsnorm(x, residual, weight, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    if with_residual:
        assert torch.equal(residual, kept)  # the inputs are left alone: the sum is a new tensor
        assert rel_err(summed, ref_sum) < TOL[dtype]
    else:
        assert summed is x


@runnable
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_layernorm_matches_torch(dtype: torch.dtype, with_residual: bool) -> None:
    """Whisper's residual add + LayerNorm; rows off zero mean (the mean must come out)."""
    from mstar.layers.triton_fused import add_layernorm, torch_add_layernorm

    gen = torch.Generator().manual_seed(3)
    hidden = 80  # not a power of two: the row block is masked, and masked lanes must not skew the variance
    x = (3 * torch.randn(7, hidden, generator=gen) + 2).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.empty(hidden).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    kept = None if residual is None else residual.clone()
    ref, ref_sum = torch_add_layernorm(x, residual, weight, bias, 1e-5)
    out, summed = add_layernorm(x, residual, weight, bias, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    plain = torch.nn.functional.layer_norm(ref_sum.float(), (hidden,), weight.float(), bias.float(), 1e-5)
    assert rel_err(out, plain) < TOL[dtype]
    if with_residual:
        assert torch.equal(residual, kept)
        exact = dtype == torch.float32 or DEVICE.type == "cuda"  # the interpreter truncates to bf16
        assert torch.equal(summed, ref_sum) if exact else rel_err(summed, ref_sum) < TOL[dtype]
    else:
        assert summed is x


@runnable
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (2 * torch.randn(5, 2 * 1100, generator=gen)).to(DEVICE, dtype)  # two column blocks, masked
    out = silu_and_mul(gate_up)
    ref = torch_silu_and_mul(gate_up)
    assert out.shape == (5, 1100) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@runnable
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_matches_torch(dtype: torch.dtype) -> None:
    """q and k are views of one fused qkv row (as in the Llama attention): rotated in place,
    v untouched; llama3-scaled frequencies at scattered positions."""
    tokens, hq, hkv, d = 4, 6, 2, 64
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(d, 500000.0, scaling)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 130, 5000], device=DEVICE), dtype)
    ref_q, ref_k = torch_rotary(q, k, cos, sin)
    v_before = v.clone()
    rotary_(q, k, cos, sin)
    assert rel_err(q, ref_q) < TOL[dtype], rel_err(q, ref_q)
    assert rel_err(k, ref_k) < TOL[dtype], rel_err(k, ref_k)
    assert torch.equal(v, v_before)


@runnable
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_writes_the_kv_cache(dtype: torch.dtype) -> None:
    """With a cache, the same kernel stores the rotated keys and the values at the tokens'
    slots, as write_kv_cache after the torch rotation does; other slots stay untouched."""
    tokens, hq, hkv, d, pages, page_size = 3, 4, 2, 32, 6, 4
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.tensor([3, 0, 17], device=DEVICE), dtype)
    slots = torch.tensor([5, 22, 9], device=DEVICE)
    want = torch.randn(2, pages, page_size, hkv, d, generator=gen).to(DEVICE, dtype)
    cache = want.clone()
    ref_q, ref_k = torch_rotary(q, k, cos, sin)
    write_kv_cache(ref_k, v, want, slots)
    rotary_(q, k, cos, sin, v=v, kv_cache=cache, slot_mapping=slots)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]
    assert rel_err(cache, want) < TOL[dtype], rel_err(cache, want)
    flat, flat_want = cache.view(2, -1, hkv, d), want.view(2, -1, hkv, d)
    others = [i for i in range(pages * page_size) if i not in (5, 22, 9)]
    assert torch.equal(flat[:, others], flat_want[:, others])


@runnable  # the wrappers refuse to launch where the kernels cannot run, before checking shapes
def test_wrappers_reject_bad_shapes() -> None:
    def t(*shape, ones=False):
        return (torch.ones if ones else torch.randn)(*shape, device=DEVICE)

    x = t(3, 8)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm(x, None, t(7, ones=True), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(x, t(3, 9), t(8, ones=True), 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(t(3, 7))
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_(t(2, 4, 8), t(2, 2, 8), t(2, 6), t(2, 6))


# ------------------------------------------------------------------------------ model
def tiny_llama(dtype: torch.dtype, rope_scaling: dict | None = None) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rope_scaling=rope_scaling)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
    return model.to(dtype).eval()


def run_steps(model: LlamaForCausalLM, dtype: torch.dtype, backend: str = "torch") -> list[torch.Tensor]:
    """Logits of a prefill of three sequences, then two decode steps."""
    layers, kv_heads, head_dim = model.cache_shape()
    caches = allocate_kv_cache(layers, 32, 4, kv_heads, head_dim, dtype, DEVICE)
    pool = PagePool(32, 4)
    gen = torch.Generator().manual_seed(3)
    lens = {"a": 5, "b": 9, "c": 1}
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (sum(lens.values()),), generator=gen).to(DEVICE)
    outs = []
    with torch.inference_mode():
        meta = step_meta(pool, [(s, 0, n) for s, n in lens.items()], DEVICE, backend)
        outs.append(model.compute_logits(model(prompt, meta, caches)))
        for _ in range(2):
            tokens = torch.randint(0, vocab, (len(lens),), generator=gen).to(DEVICE)
            meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], DEVICE, backend)
            outs.append(model.compute_logits(model(tokens, meta, caches)))
            lens = {s: n + 1 for s, n in lens.items()}
    return outs


@runnable
def test_llama_fused_matches_eager_fp32() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4}
    model = tiny_llama(torch.float32, scaling)
    eager = run_steps(model, torch.float32)
    model.use_fused_kernels()
    assert model.fused_kernels and model.model.layers[1].mlp.fused_kernels
    fused = run_steps(model, torch.float32)
    for step, (a, b) in enumerate(zip(fused, eager)):
        assert rel_err(a, b) < 1e-5, (step, rel_err(a, b))
    model.use_fused_kernels(False)
    assert torch.equal(run_steps(model, torch.float32)[-1], eager[-1])  # eager is unchanged by the switch


@runnable
def test_qwen3_fused_matches_eager_fp32() -> None:
    """Qwen3's per-head q/k norms before the in-place RoPE kernel (Canary-Qwen's LLM)."""
    from mstar.model.qwen3.causal import Qwen3ForCausalLM
    from mstar.model.qwen3.config import Qwen3Config

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
    model = model.eval()
    eager = run_steps(model, torch.float32)
    model.use_fused_kernels()
    assert model.model.layers[0].self_attn.q_norm.fused_kernels
    fused = run_steps(model, torch.float32)
    for step, (a, b) in enumerate(zip(fused, eager)):
        assert rel_err(a, b) < 1e-5, (step, rel_err(a, b))


def test_switch_is_read_from_model_kwargs() -> None:
    """``model_kwargs.fused_kernels`` is checked when the knobs are parsed (a boolean, on CUDA
    only) and reaches the model when the decode engine is built."""
    with pytest.raises(ConfigError, match="model_kwargs.fused_kernels: must be true or false"):
        DecodeKnobs.parse({"fused_kernels": "yes"}, device="cuda")
    with pytest.raises(ConfigError, match="model_kwargs.fused_kernels needs device: cuda"):
        DecodeKnobs.parse({"fused_kernels": True}, device="cpu")
    model = tiny_llama(torch.float32)
    model.use_fused_kernels(True)
    config = DeploymentConfig(model="llama", device=DEVICE.type, max_seq_len=64,
                              resources={"kv_cache": {"max_num_pages": 8}})
    decode_engine(model, DecodeKnobs.parse({}, device=DEVICE.type), config, DEVICE)
    assert not model.fused_kernels
    if DEVICE.type == "cuda":
        decode_engine(model, DecodeKnobs.parse({"fused_kernels": True}, device="cuda"), config, DEVICE)
        assert model.fused_kernels


# -------------------------------------------------------------------------------- GPU
@needs_cuda
def test_llama_fused_matches_eager_bf16_on_gpu() -> None:
    model = gpu_llama(DEVICE, torch.bfloat16)
    eager = run_steps(model, torch.bfloat16, "triton")
    model.use_fused_kernels()
    fused = run_steps(model, torch.bfloat16, "triton")
    for step, (a, b) in enumerate(zip(fused, eager)):
        assert rel_err(a, b) < 2e-2, (step, rel_err(a, b))


@needs_cuda
def test_cuda_graph_decode_with_fused_kernels() -> None:

    model = gpu_llama(DEVICE, torch.bfloat16)  # head_dim 64, as the graph runner's own tests
    caches = allocate_kv_cache(2, 32, 4, 2, 64, torch.bfloat16, DEVICE)
    graph_caches = [c.clone() for c in caches]
    runner = decode_graphs(model, graph_caches, 4, 8, batch_sizes=(1, 4))
    rng = random.Random(0)
    pool = PagePool(31, 4)  # the last page is the runner's scratch page
    lens = {f"s{i}": rng.randint(1, 12) for i in range(3)}
    with torch.inference_mode():
        model.use_fused_kernels()
        prompt = torch.randint(0, 512, (sum(lens.values()),), device=DEVICE)
        model(prompt, step_meta(pool, [(s, 0, n) for s, n in lens.items()], DEVICE), caches)
        for layer, cache in enumerate(caches):
            graph_caches[layer].copy_(cache)
        for _ in range(2):  # the second step replays the captured graph with new inputs
            tokens = torch.randint(0, 512, (len(lens),), device=DEVICE)
            meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], DEVICE, "triton")
            graphed = runner.run(tokens, meta)
            model.use_fused_kernels(False)
            eager = model.compute_logits(model(tokens, replace(meta, backend="torch"), caches))
            model.use_fused_kernels()
            assert rel_err(graphed, eager) < 2e-2, rel_err(graphed, eager)
            lens = {s: n + 1 for s, n in lens.items()}
    assert runner.captured_batch_sizes == (4,)
