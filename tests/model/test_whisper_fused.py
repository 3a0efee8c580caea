"""Whisper's decoder with ``fused_kernels`` (one q/k/v GEMM, the attention scale in the
kernels, residual add + LayerNorm in one Triton kernel, no cross-attention sink writes; at a
few rows every projection a Triton GEMV with the norm, GELU and KV write folded in) against
the plain decoder, on tiny random models in float32, and the kernels a layer's step launches.

Without a GPU the Triton kernels run under the interpreter; as in test_whisper_triton.py, when
Triton was imported before ``TRITON_INTERPRET`` was set the tests rerun this file in a fresh
process (``test_kernels_in_a_fresh_interpreter``) rather than go unrun.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_whisper_cross_slots import (  # noqa: E402
    FRAMES,
    PAGE_SIZE,
    SOT,
    compare_graph_runner,
    mixed_steps,
    rel_err,
    step_meta,
    tiny_model,
    written_slots,
)
from test_whisper_overlap import make_engine, request, serve  # noqa: E402

from mstar.engine.page_pool import PagePool  # noqa: E402
from mstar.layers import triton_attention, triton_fused, triton_gemv  # noqa: E402
from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.whisper.cross_kv import CrossAttentionBatch  # noqa: E402
from mstar.model.whisper.modeling import DECODE_GEMV_ROWS  # noqa: E402
from tests.support.host_reads import HostReads
from tests.support.kernel_count import KernelCount
from tests.support.triton_interpreter import (
    DEVICE,
    REASON,
    index_interpreted_scalars,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

RUNNABLE = kernels_runnable(triton_fused)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)
TOL = 1e-5

if RUNNABLE and triton_fused.INTERPRET:
    index_interpreted_scalars()


@pytest.mark.slow  # a whole pytest process of its own
@pytest.mark.skipif(RUNNABLE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter() -> None:
    rerun_in_fresh_interpreter(__file__)


def fused_twin(model):
    twin = copy.deepcopy(model)
    twin.use_fused_kernels()
    return twin


def test_fused_qkv_weights_stay_the_parameters() -> None:
    """The q/k/v parameters become views of the concatenated weight: a later load fills both."""
    model = fused_twin(tiny_model())
    attn = model.model.decoder.layers[0].self_attn
    d = attn.q_proj.weight.shape[0]
    assert torch.equal(attn.qkv_bias[d:2 * d], torch.zeros(d))
    fresh = tiny_model(seed=9)
    model.load_state_dict(fresh.state_dict(), strict=True)
    want = fresh.model.decoder.layers[0].self_attn
    assert torch.equal(attn.qkv_weight, torch.cat([want.q_proj.weight, want.k_proj.weight, want.v_proj.weight]))
    assert torch.equal(attn.qkv_bias[2 * d:], want.v_proj.bias)


@runnable
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_decoder_matches_plain_over_prefill_and_decodes(backend: str) -> None:
    """A mixed prefill, then decodes of sequences at different lengths, through ``decode`` with
    and without fused kernels on twin caches: same hidden states, same K/V, untouched sink."""
    plain = tiny_model(DEVICE)
    models = {"plain": plain, "fused": fused_twin(plain)}
    layers, heads, head_dim = plain.kv_layout()
    cross, slot = written_slots(plain, DEVICE)
    caches = {k: allocate_kv_cache(layers, 16, PAGE_SIZE, heads, head_dim, torch.float32, DEVICE) for k in models}
    pool = PagePool(16, PAGE_SIZE)
    gen = torch.Generator().manual_seed(8)
    steps = mixed_steps()
    for chunks in steps:
        ids = torch.randint(0, SOT, (sum(end - start for _, start, end in chunks),), generator=gen).to(DEVICE)
        counts = [end - start for _, start, end in chunks]
        slots = torch.tensor([slot[r] for r, _, _ in chunks], device=DEVICE)
        meta = step_meta(pool, chunks, backend, DEVICE)
        batch = CrossAttentionBatch.build(slots, counts, frames=FRAMES, sink=cross.sink, backend=backend)
        hidden = {}
        for name, model in models.items():
            cross.layers[0][:, cross.sink].zero_()
            with torch.no_grad():
                hidden[name] = model.decode(ids, meta, caches[name], cross.layers, batch)
            if name == "fused":
                assert not cross.layers[0][:, cross.sink].any()  # no sink writes
        assert rel_err(hidden["fused"], hidden["plain"]) <= TOL, chunks
    for fused, want in zip(caches["fused"], caches["plain"]):
        assert rel_err(fused, want) <= TOL


def one_layer_step(model, rows: int) -> tuple[KernelCount, HostReads]:
    """The kernels and host reads of decoder layer 0's ``forward_fused`` in a Triton-backend
    step of ``rows`` sequences, each one new token at position 5 (for ``rows`` > 3: one
    sequence's prefill of ``rows`` tokens), after a first call (the one-time buffers)."""
    layers, heads, head_dim = model.kv_layout()
    cross, slot = written_slots(model, DEVICE)
    kv = allocate_kv_cache(layers, 16, PAGE_SIZE, heads, head_dim, torch.float32, DEVICE)
    pool = PagePool(16, PAGE_SIZE)
    if rows <= 3:
        chunks, counts = [(r, 5, 6) for r in "abc"[:rows]], None
    else:
        chunks, counts = [("a", 0, rows)], [rows]
    meta = step_meta(pool, chunks, "triton", DEVICE)
    batch = CrossAttentionBatch.build(torch.tensor([slot[r] for r, _, _ in chunks], device=DEVICE), counts,
                                      frames=FRAMES, sink=cross.sink, backend="triton")
    delta, x = torch.randn(2, sum(end - start for _, start, end in chunks), model.config.d_model).to(DEVICE)
    layer = model.model.decoder.layers[0]
    with torch.no_grad():
        layer.forward_fused(delta, x, meta, kv[0], cross.layers[0], batch)  # a warm-up, as before a capture
        with HostReads() as reads, KernelCount(triton_gemv, triton_fused, triton_attention) as seen:
            layer.forward_fused(delta, x, meta, kv[0], cross.layers[0], batch)
    return seen, reads


@runnable
def test_a_few_row_step_is_eight_kernels_a_layer(monkeypatch) -> None:
    """Up to ``DECODE_GEMV_ROWS`` rows a layer is three LayerNorm + GEMV kernels (qkv with the
    KV write, cross q, fc1 with GELU), three GEMVs (o, cross o, fc2) and the two attention
    kernels, their KV splits merged in the kernel: no ATen compute op, no host read
    (CUDA-graph capture). Above, ``forward_fused`` as before: 14 at this five-token prefill (a
    one-row step took 15 that way here, the cross-attention's split combine included; on a GPU
    both attentions split, and cuBLAS may add split-K reduces). The KV is split more finely
    than the CPU's tiling would, as a one-row GPU step splits it (there: into some 14 ranges at
    Whisper large's 20 heads). A change that adds a kernel to the small step must change
    this count."""
    tiling = triton_attention._tiling(torch.device("cpu"), 8)
    monkeypatch.setattr(triton_attention, "_tiling", lambda device, head_dim: replace(tiling, min_tokens_per_split=4))
    model = fused_twin(tiny_model(DEVICE))
    for rows in (1, 2, 3):
        assert rows <= DECODE_GEMV_ROWS
        seen, reads = one_layer_step(model, rows)
        assert seen.kernels == {"triton:_gemv_kernel": 6, "triton:_decode_kernel": 2}, seen.report()
        assert reads.count() == 0 and not reads.uploads, reads.report()
    seen, _ = one_layer_step(model, DECODE_GEMV_ROWS + 1)
    assert seen.total() == 14 and seen.kernels["triton:_gemv_kernel"] == 0, seen.report()


@runnable
def test_gemv_step_without_exact_gelu_applies_the_activation() -> None:
    """An activation other than erf GELU (ReLU here) runs as its own op between fc1 and
    fc2: the same hidden states as the plain decoder at one row."""
    plain = tiny_model(DEVICE)
    for layer in plain.model.decoder.layers:
        layer.act = torch.nn.functional.relu
    fused = fused_twin(plain)
    layers, heads, head_dim = plain.kv_layout()
    cross, slot = written_slots(plain, DEVICE)
    pool = PagePool(16, PAGE_SIZE)
    meta = step_meta(pool, [("a", 0, 1)], "triton", DEVICE)
    batch = CrossAttentionBatch.build(torch.tensor([slot["a"]], device=DEVICE), None, frames=FRAMES,
                                      sink=cross.sink, backend="triton")
    ids = torch.tensor([SOT], device=DEVICE)
    hidden = []
    for model in (plain, fused):
        kv = allocate_kv_cache(layers, 16, PAGE_SIZE, heads, head_dim, torch.float32, DEVICE)
        with torch.no_grad():
            hidden.append(model.decode(ids, meta, kv, cross.layers, batch))
    assert rel_err(hidden[1], hidden[0]) <= TOL


@runnable
def test_graph_runner_with_fused_kernels() -> None:
    """The bucketed runner (a CUDA graph on the GPU, eager buffers on the CPU) over the fused
    decoder against eager fused decodes."""
    compare_graph_runner(fused_twin(tiny_model(DEVICE)), "triton", DEVICE, torch.float32, tol=TOL)


@runnable
def test_engine_with_every_switch_matches_plain_eager_engine() -> None:
    """Fused kernels + decode graphs (eager on the CPU) + overlap + Triton attention against the
    plain eager torch engine: the same greedy tokens, detect_language and translate included."""
    plain = tiny_model(DEVICE)
    requests = {"a": request([SOT, 101, 103, 105], 14), "b": request([SOT], 10, detect=True, task="translate"),
                "c": request([SOT, 102, 103, 105], 6)}
    joins = {"a": 0, "b": 1, "c": 3}
    want, _ = serve(make_engine(plain, False), requests, joins)
    fast = make_engine(fused_twin(plain), True, backend="triton", cuda_graphs=True)
    got, ahead_used = serve(fast, requests, joins)
    assert got == want and ahead_used and fast.graphs.captured_batch_sizes


def test_s4_smoke_with_overlap_and_fused_kernels(tmp_path) -> None:
    """benchmarks/s4_whisper.py --smoke --overlap --fused-kernels (a process of its own: the
    Triton kernels run interpreted on the CPU)."""
    import json

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "benchmarks/s4_whisper.py", "--smoke", "--overlap", "--fused-kernels", "--skip-baseline",
         "--new-tokens", "4", "--warmup-tokens", "2", "--batches", "1,2", "--runs", "1", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    assert records and records[0]["settings"]["overlap_scheduling"] and records[0]["settings"]["fused_kernels"]
    assert records[0]["ours"]["1"]["rtf"] > 0
