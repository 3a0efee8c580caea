"""The fused small-batch GEMV kernels (``mstar.layers.triton_gemv``) against their torch
compositions, and the Llama decoder's GEMV path (``forward_gemv``) against eager torch.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (see
tests/support/triton_interpreter.py and test_triton_fused.py, which this file follows); when
something imported Triton first in this session, ``test_kernels_in_a_fresh_interpreter``
runs this file again in a process of its own. bf16 checks run on CUDA only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers import triton_gemv  # noqa: E402
from mstar.layers.paged_kv import write_kv_cache  # noqa: E402
from mstar.layers.triton_fused import torch_add_layernorm, torch_add_rmsnorm, torch_silu_and_mul  # noqa: E402
from mstar.layers.triton_gemv import (  # noqa: E402
    GEMV_MAX_ROWS,
    GemvConfig,
    KVWrite,
    gemv,
    layernorm_gemv,
    rmsnorm_gemv,
)
from mstar.model.llama import LlamaConfig, LlamaForCausalLM, modeling  # noqa: E402
from mstar.model.llama.modeling import GemvRule  # noqa: E402
from tests.support.markers import needs_cuda
from tests.support.triton_interpreter import (
    DEVICE,
    REASON,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

RUNNABLE = kernels_runnable(triton_gemv)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

# Max error relative to the reference's largest magnitude. fp32: reduction order only.
# bf16 (CUDA only): an ulp of the output, and of the rounded gate/up and normalised rows.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
N, K = 97, 150  # odd: neither is a multiple of the blocks, so both masks are exercised


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


@pytest.mark.slow  # a whole pytest process of its own
@pytest.mark.skipif(RUNNABLE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter() -> None:
    rerun_in_fresh_interpreter(__file__, allow_skips=True)  # the GPU test skips on the CPU


# ---------------------------------------------------------------------------- kernels
@runnable
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_matches_linear(dtype: torch.dtype, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = rand(gen, N, K, dtype=dtype, scale=K**-0.5)
    bias = rand(gen, N, dtype=dtype) if with_bias else None
    for rows in range(1, 5):
        x = rand(gen, rows, K, dtype=dtype)
        y = gemv(x, weight, bias)
        ref = F.linear(x, weight, bias)
        assert y.shape == (rows, N) and y.dtype == dtype
        assert rel_err(y, ref) < TOL[dtype], (rows, rel_err(y, ref))


@runnable
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_gemv_matches_norm_then_linear(dtype: torch.dtype, with_bias: bool, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = rand(gen, N, K, dtype=dtype, scale=K**-0.5)
    bias = rand(gen, N, dtype=dtype) if with_bias else None
    norm_w = torch.empty(K).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    for rows in range(1, 5):
        x = rand(gen, rows, K, dtype=dtype, scale=3.0)
        residual = rand(gen, rows, K, dtype=dtype) if with_residual else None
        kept = None if residual is None else residual.clone()
        normed, ref_sum = torch_add_rmsnorm(x, residual, norm_w, 1e-5)
        y, summed = rmsnorm_gemv(x, residual, norm_w, 1e-5, weight, bias)
        assert y.shape == (rows, N) and y.dtype == dtype
        assert rel_err(y, F.linear(normed, weight, bias)) < TOL[dtype], rows
        check_summed(x, residual, kept, summed, ref_sum)


def check_summed(x: torch.Tensor, residual: torch.Tensor | None, kept: torch.Tensor | None, summed: torch.Tensor,
                 ref_sum: torch.Tensor) -> None:
    """A norm prologue's residual sum: the residual left as it was and the sum exact (the
    interpreter truncates bf16 sums), or ``x`` itself without a residual."""
    if residual is None:
        assert summed is x
        return
    assert torch.equal(residual, kept)
    exact = x.dtype == torch.float32 or DEVICE.type == "cuda"  # the interpreter truncates to bf16
    assert torch.equal(summed, ref_sum) if exact else rel_err(summed, ref_sum) < TOL[x.dtype]


@runnable
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_gemv_silu_mul_matches_torch(dtype: torch.dtype, with_bias: bool) -> None:
    """``[gate | up]`` weight with an odd half (masked), leading batch dimensions kept."""
    gen = torch.Generator().manual_seed(2)
    weight = rand(gen, 2 * N, K, dtype=dtype, scale=2 * K**-0.5)
    bias = rand(gen, 2 * N, dtype=dtype) if with_bias else None
    norm_w = torch.empty(K).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    for rows in range(1, 5):
        x, residual = rand(gen, rows, 1, K, dtype=dtype), rand(gen, rows, 1, K, dtype=dtype)
        normed, ref_sum = torch_add_rmsnorm(x, residual, norm_w, 1e-5)
        ref = torch_silu_and_mul(F.linear(normed, weight, bias))
        y, summed = rmsnorm_gemv(x, residual, norm_w, 1e-5, weight, bias, silu_mul=True)
        assert y.shape == (rows, 1, N) and y.dtype == dtype and summed.shape == x.shape
        assert rel_err(y, ref) < TOL[dtype], (rows, rel_err(y, ref))
        assert rel_err(summed, ref_sum) < TOL[dtype]


def layer_norm_params(gen: torch.Generator, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.empty(k).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    return weight, rand(gen, k, dtype=dtype, scale=0.5)


@runnable
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_gemv_matches_norm_then_linear(dtype: torch.dtype, with_bias: bool, with_residual: bool) -> None:
    """Rows with a large common offset, so a one-pass variance would lose the fp32 digits."""
    gen = torch.Generator().manual_seed(11)
    weight = rand(gen, N, K, dtype=dtype, scale=K**-0.5)
    bias = rand(gen, N, dtype=dtype) if with_bias else None
    norm_w, norm_b = layer_norm_params(gen, K, dtype)
    for rows in range(1, 5):
        x = rand(gen, rows, K, dtype=dtype, scale=3.0) + 20.0
        residual = rand(gen, rows, K, dtype=dtype) if with_residual else None
        kept = None if residual is None else residual.clone()
        normed, ref_sum = torch_add_layernorm(x, residual, norm_w, norm_b, 1e-5)
        y, summed = layernorm_gemv(x, residual, norm_w, norm_b, 1e-5, weight, bias)
        assert y.shape == (rows, N) and y.dtype == dtype
        assert rel_err(y, F.linear(normed, weight, bias)) < TOL[dtype], rows
        check_summed(x, residual, kept, summed, ref_sum)


@runnable
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_epilogue_matches_torch(dtype: torch.dtype) -> None:
    """``F.gelu`` of the GEMM output, plain and after the LayerNorm prologue (leading batch
    dimensions kept)."""
    gen = torch.Generator().manual_seed(12)
    weight, bias = rand(gen, N, K, dtype=dtype, scale=2 * K**-0.5), rand(gen, N, dtype=dtype)
    norm_w, norm_b = layer_norm_params(gen, K, dtype)
    for rows in range(1, 5):
        x, residual = rand(gen, rows, 1, K, dtype=dtype), rand(gen, rows, 1, K, dtype=dtype)
        ref = F.gelu(F.linear(x, weight, bias))
        y = gemv(x, weight, bias, gelu=True)
        assert y.shape == (rows, 1, N) and rel_err(y, ref) < TOL[dtype], rows
        normed, _ = torch_add_layernorm(x, residual, norm_w, norm_b, 1e-5)
        y, _ = layernorm_gemv(x, residual, norm_w, norm_b, 1e-5, weight, bias, gelu=True)
        assert rel_err(y, F.gelu(F.linear(normed, weight, bias))) < TOL[dtype], rows


def qkv_cache_case(gen: torch.Generator, rows: int, dtype: torch.dtype):
    """A fused ``[q | k | v]`` weight of 3 heads of 8 (K = ``K``), a paged cache of 5 pages of
    4 slots, and ``rows`` distinct slots."""
    heads, head_dim, pages, page_size = 3, 8, 5, 4
    width = heads * head_dim
    weight, bias = rand(gen, 3 * width, K, dtype=dtype, scale=K**-0.5), rand(gen, 3 * width, dtype=dtype)
    cache = rand(gen, 2, pages, page_size, heads, head_dim, dtype=dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:rows].to(DEVICE)
    return weight, bias, cache, slots, (heads, head_dim)


@runnable
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_stores_keys_and_values_as_write_kv_cache(dtype: torch.dtype, split: int) -> None:
    """The q/k/v GEMV's epilogue writes k and v into the cache exactly as ``write_kv_cache``
    writes the GEMM's k and v (with and without split K; the other slots untouched), after
    the LayerNorm prologue too."""
    gen = torch.Generator().manual_seed(13)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=split)
    norm_w, norm_b = layer_norm_params(gen, K, dtype)
    for rows in (1, 3):
        weight, bias, cache, slots, (heads, head_dim) = qkv_cache_case(gen, rows, dtype)
        width = heads * head_dim
        x, residual = rand(gen, rows, K, dtype=dtype), rand(gen, rows, K, dtype=dtype)
        for norm in (False, True):
            got, want = cache.clone(), cache.clone()
            write = KVWrite(got, slots, first=width)
            if norm:
                normed, _ = torch_add_layernorm(x, residual, norm_w, norm_b, 1e-5)
                ref = F.linear(normed, weight, bias)
                y, _ = layernorm_gemv(x, residual, norm_w, norm_b, 1e-5, weight, bias, kv_write=write, config=config)
            else:
                ref = F.linear(x, weight, bias)
                y = gemv(x, weight, bias, kv_write=write, config=config)
            assert rel_err(y, ref) < TOL[dtype]
            _, k, v = y.unflatten(-1, (3, heads, head_dim)).unbind(-3)
            write_kv_cache(k, v, want, slots)
            assert torch.equal(got, want), (rows, norm)


@runnable
def test_gemv_takes_up_to_the_row_limit() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = rand(gen, N, K, dtype=torch.float32)
    x = rand(gen, GEMV_MAX_ROWS, K, dtype=torch.float32)
    assert rel_err(gemv(x, weight), F.linear(x, weight)) < TOL[torch.float32]


@runnable
@pytest.mark.parametrize(("rows", "split"), [(5, 2), (40, 3)])
def test_split_k_and_wide_rows_match_torch(rows: int, split: int) -> None:
    """K split over ``split`` programs per tile (the last of 3 splits gets a partial slice,
    so the masked path runs too) at 16- and 64-column padding: plain, SiLU * up epilogue,
    and the norm prologue; the arrival counters are left at zero for the next launch."""
    gen = torch.Generator().manual_seed(5)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=split)
    dtype = DTYPES[-1]
    weight, bias = rand(gen, 2 * N, K, dtype=dtype, scale=K**-0.5), rand(gen, 2 * N, dtype=dtype)
    norm_w = torch.empty(K).uniform_(0.5, 1.5, generator=gen).to(DEVICE, dtype)
    x, residual = rand(gen, rows, K, dtype=dtype), rand(gen, rows, K, dtype=dtype)
    assert rel_err(gemv(x, weight, bias, config=config), F.linear(x, weight, bias)) < TOL[dtype]
    ref = torch_silu_and_mul(F.linear(x, weight, bias))
    assert rel_err(gemv(x, weight, bias, silu_mul=True, config=config), ref) < TOL[dtype]
    normed, ref_sum = torch_add_rmsnorm(x, residual, norm_w, 1e-5)
    y, summed = rmsnorm_gemv(x, residual, norm_w, 1e-5, weight, None, silu_mul=True, config=config)
    assert rel_err(y, torch_silu_and_mul(F.linear(normed, weight))) < TOL[dtype]
    assert rel_err(summed, ref_sum) < TOL[dtype]
    assert not triton_gemv._counters[x.device].any()


@runnable
def test_weights_through_the_copy_engine_match_torch() -> None:
    """``GemvConfig.tma``: the weight tiles as tensor-descriptor loads (zero past the edges),
    plain and SiLU * up, with a split K; rows of 152 floats are 16-byte aligned."""
    gen = torch.Generator().manual_seed(6)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=3, tma=True)
    k = 152
    weight, x = rand(gen, 2 * N, k, dtype=torch.float32, scale=k**-0.5), rand(gen, 5, k, dtype=torch.float32)
    assert rel_err(gemv(x, weight, config=config), F.linear(x, weight)) < TOL[torch.float32]
    ref = torch_silu_and_mul(F.linear(x, weight))
    assert rel_err(gemv(x, weight, silu_mul=True, config=config), ref) < TOL[torch.float32]


@runnable  # the wrappers refuse to launch where the kernels cannot run, before checking shapes
def test_wrappers_reject_bad_shapes() -> None:
    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE).to(dtype)

    x, w = t(2, 8), t(6, 8)
    with pytest.raises(ValueError, match="x has 7 features"):
        gemv(t(2, 7), w)
    with pytest.raises(ValueError, match="weight must be"):
        gemv(x, t(6, 8, 1))
    with pytest.raises(ValueError, match="bias has shape"):
        gemv(x, w, t(5))
    with pytest.raises(ValueError, match="weight is torch.float16"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="at most GEMV_MAX_ROWS"):
        gemv(t(GEMV_MAX_ROWS + 1, 8), w)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, t(8, 6).t())
    with pytest.raises(ValueError, match="residual has shape"):
        rmsnorm_gemv(x, t(3, 8), t(8), 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        rmsnorm_gemv(x, None, t(7), 1e-6, w)
    with pytest.raises(ValueError, match="even number of rows"):
        rmsnorm_gemv(x, None, t(8), 1e-6, t(7, 8), silu_mul=True)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv(x, t(7, 8), silu_mul=True)
    with pytest.raises(ValueError, match="two epilogues"):
        gemv(x, w, silu_mul=True, gelu=True)
    with pytest.raises(ValueError, match="norm_bias has shape"):
        layernorm_gemv(x, None, t(8), t(7), 1e-5, w)
    cache = t(2, 3, 2, 1, 2)  # keys and values 2 features wide
    with pytest.raises(ValueError, match="do not fit 6 output features"):
        gemv(x, w, kv_write=KVWrite(cache, torch.zeros(2, dtype=torch.int64, device=DEVICE), first=3))
    with pytest.raises(ValueError, match="does not fit 2 rows"):
        gemv(x, w, kv_write=KVWrite(cache, torch.zeros(3, dtype=torch.int64, device=DEVICE), first=2))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, w, kv_write=KVWrite(cache.transpose(1, 2), torch.zeros(2, dtype=torch.int64, device=DEVICE), first=2))


# ------------------------------------------------------------------------------ model
def tiny_llama(bias: bool = False) -> LlamaForCausalLM:
    """Two fp32 layers; with ``bias``, random biases on every projection (Qwen-style qkv
    bias, and o, gate_up and down biases through the row-parallel and SiLU paths)."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
        elif name.endswith("bias"):
            torch.nn.init.normal_(param)
    return model.eval()


# rule name: (rule, calls of rmsnorm_gemv and of gemv in two decode steps of two layers)
RULES = {
    "norm_prologue": (GemvRule(qkv=4, o=4, gate_up=4, down=4, norm_prologue=4), (8, 8)),
    "norm_kernel": (GemvRule(qkv=4, o=4, gate_up=4, down=4, norm_prologue=0), (0, 16)),
    "mixed": (GemvRule(qkv=0, o=4, gate_up=4, down=0, norm_prologue=0), (0, 8)),  # cuBLAS for qkv, down
}


@runnable
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_llama_gemv_path_matches_eager(rows: int, bias: bool, rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of ``rows`` rows through ``forward_gemv`` equal the eager model's logits
    (fp32, interpreter), with biases too: the add + norm as the GEMV's prologue or as a
    kernel of its own, some projections on cuBLAS; prefills (more rows) take the old path."""
    monkeypatch.setattr(modeling, "DECODE_GEMV", RULES[rule][0])  # the paths, whatever the tuned rule
    model = tiny_llama(bias)
    calls = {"rmsnorm_gemv": [], "gemv": []}

    def spy(name: str):
        real, seen = getattr(triton_gemv, name), calls[name]

        def counted(x, *args, **kwargs):
            seen.append(x.shape[0])
            return real(x, *args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(triton_gemv, name, spy(name))
    steps = run_steps_with_rows(model, rows)
    eager = steps(fused=False)
    assert not calls["rmsnorm_gemv"] and not calls["gemv"]
    fused = steps(fused=True)
    assert set(calls["rmsnorm_gemv"] + calls["gemv"]) == {rows}  # the prefill (more rows) took the old path
    assert (len(calls["rmsnorm_gemv"]), len(calls["gemv"])) == RULES[rule][1]
    for step, (a, b) in enumerate(zip(fused, eager)):
        assert rel_err(a, b) < 1e-5, (step, rel_err(a, b))


def run_steps_with_rows(model, rows: int):
    """``steps(fused)``: logits of a prefill of ``rows`` sequences, then two decode steps."""
    from test_cuda_graphs import step_meta

    from mstar.engine.page_pool import PagePool
    from mstar.layers.paged_kv import allocate_kv_cache

    def steps(fused: bool) -> list[torch.Tensor]:
        model.use_fused_kernels(fused)
        layers, kv_heads, head_dim = model.cache_shape()
        caches = allocate_kv_cache(layers, 32, 4, kv_heads, head_dim, torch.float32, DEVICE)
        pool = PagePool(32, 4)
        gen = torch.Generator().manual_seed(4)
        lens = {f"s{i}": 5 + 2 * i for i in range(rows)}  # prefills of more than 4 rows
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (sum(lens.values()),), generator=gen).to(DEVICE)
        outs = []
        with torch.inference_mode():
            meta = step_meta(pool, [(s, 0, n) for s, n in lens.items()], DEVICE)
            outs.append(model.compute_logits(model(prompt, meta, caches)))
            for _ in range(2):
                tokens = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
                meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], DEVICE)
                outs.append(model.compute_logits(model(tokens, meta, caches)))
                lens = {s: n + 1 for s, n in lens.items()}
        return outs

    return steps


@runnable
def test_llama_rows_above_the_threshold_take_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the threshold at 2, three-row decode steps never call the GEMV kernels (and still
    match eager); at 0 the path is off for every step."""
    model = tiny_llama()

    def refuse(*args, **kwargs):
        raise AssertionError("GEMV kernel called above the threshold")

    monkeypatch.setattr(triton_gemv, "rmsnorm_gemv", refuse)
    monkeypatch.setattr(triton_gemv, "gemv", refuse)
    steps = run_steps_with_rows(model, 3)
    eager = steps(fused=False)
    for threshold in (2, 0):
        monkeypatch.setattr(modeling, "DECODE_GEMV", GemvRule(threshold, threshold, threshold, threshold, threshold))
        fused = steps(fused=True)
        for a, b in zip(fused, eager):
            assert rel_err(a, b) < 1e-5
    monkeypatch.setattr(modeling, "DECODE_GEMV", GemvRule(3, 3, 3, 3, 3))  # the spy must be able to fail
    with pytest.raises(AssertionError, match="above the threshold"):
        steps(fused=True)


# -------------------------------------------------------------------------------- GPU
@needs_cuda
@pytest.mark.parametrize("every_projection", [False, True], ids=["tuned_rule", "all_kernels"])
@pytest.mark.parametrize("streams", [3, 20, 50])
def test_llama_gemv_path_bf16_in_a_cuda_graph(streams: int, every_projection: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 decode of ``streams`` rows (buckets 4, 32, 64) from a captured graph, the GEMV
    kernels inside where the tuned rule (``modeling.DECODE_GEMV``) puts them, or for every
    projection (norm prologue up to 4 rows); the tiny model's few output tiles split K.
    Against the eager model."""
    if every_projection:
        monkeypatch.setattr(modeling, "DECODE_GEMV", GemvRule(qkv=64, o=64, gate_up=64, down=64, norm_prologue=4))
    from test_cuda_graphs import decode_graphs, step_meta
    from test_cuda_graphs import tiny_llama as gpu_llama

    from mstar.engine.page_pool import PagePool
    from mstar.layers.paged_kv import allocate_kv_cache

    model = gpu_llama(DEVICE, torch.bfloat16)
    caches = allocate_kv_cache(2, 256, 4, 2, 64, torch.bfloat16, DEVICE)
    graph_caches = [c.clone() for c in caches]
    runner = decode_graphs(model, graph_caches, 4, 8, batch_sizes=(1, 4, 32, 64))
    pool = PagePool(255, 4)
    gen = torch.Generator().manual_seed(streams)
    lens = {f"s{i}": int(n) for i, n in enumerate(torch.randint(2, 10, (streams,), generator=gen))}
    with torch.inference_mode():
        prompt = torch.randint(0, 512, (sum(lens.values()),), device=DEVICE)
        model(prompt, step_meta(pool, [(s, 0, n) for s, n in lens.items()], DEVICE), caches)
        for layer, cache in enumerate(caches):
            graph_caches[layer].copy_(cache)
        for _ in range(2):
            tokens = torch.randint(0, 512, (len(lens),), device=DEVICE)
            meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], DEVICE, "triton")
            model.use_fused_kernels()
            graphed = runner.run(tokens, meta)
            model.use_fused_kernels(False)
            eager = model.compute_logits(model(tokens, meta, caches))
            assert rel_err(graphed, eager) < 2e-2, rel_err(graphed, eager)
            lens = {s: n + 1 for s, n in lens.items()}


# ------------------------------------------------------------ programmatic dependent launch
def test_pdl_launch_settings() -> None:
    """PDL is never asked for on CPU tensors; a GEMV's L2 prefetch is its share of the budget
    in whole 128-byte lines, a power of two, at most its K slice, none when off or too small."""
    from mstar.layers.triton_support import launch_options, pdl, set_pdl

    assert not pdl(torch.zeros(2))
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
    try:
        set_pdl(True, 2 << 20)
        columns = triton_gemv._prefetch_columns
        assert columns(True, 128, 32, 4096, 2) == 256  # 2 MB over 128 programs x 32 rows x 2 bytes
        assert columns(True, 4, 32, 96, 2) == 64  # capped by the K slice, rounded down to a power of two
        assert columns(True, 1 << 16, 128, 4096, 2) == 0  # under one line a row: none
        assert columns(False, 128, 32, 4096, 2) == 0
        set_pdl(True, 0)
        assert columns(True, 128, 32, 4096, 2) == 0
    finally:
        set_pdl(None, 2 << 20)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 5, 20])
def test_pdl_launches_give_the_same_logits(rows: int) -> None:
    """The fused decode path (every projection on the GEMV kernels, L2 prefetch on), eagerly and
    from a captured graph, gives bit-identical logits with and without programmatic dependent
    launch: the kernels are the same, only when they may start differs. Skips where the GPU
    has no PDL (before compute capability 9.0)."""
    from test_cuda_graphs import eager_and_graphed_step
    from test_cuda_graphs import tiny_llama as gpu_llama

    from mstar.layers.triton_support import pdl, set_pdl

    if not pdl(torch.zeros(1, device=DEVICE)):
        pytest.skip("this GPU takes no programmatic dependent launch")
    model = gpu_llama(DEVICE, torch.bfloat16)
    model.use_fused_kernels()
    lens = {f"s{i}": 3 + i for i in range(rows)}
    prompt = torch.randint(0, 512, (sum(lens.values()),), device=DEVICE)
    tokens = torch.randint(0, 512, (rows,), device=DEVICE)
    results = {}
    try:
        with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(modeling, "DECODE_GEMV", GemvRule(qkv=64, o=64, gate_up=64, down=64, norm_prologue=0))
            for on in (False, True):
                set_pdl(on, 1 << 20)
                results[on] = eager_and_graphed_step(model, lens, prompt, tokens, DEVICE)
    finally:
        set_pdl(None, 2 << 20)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][1], results[True][0])
