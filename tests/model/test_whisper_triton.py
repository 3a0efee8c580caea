"""Whisper's decoder on the Triton attention backend (self-attention through the paged
kernels, cross-attention through the decode kernel over the slots) against the torch path.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET``
is set before ``mstar.layers.triton_attention`` is first imported (as in
tests/layers/test_triton_attention.py). When something else imported Triton first in this
session (``torch._dynamo`` does, e.g. through transformers), the kernel tests skip here and
``test_kernels_in_a_fresh_interpreter`` runs this file again in a process of its own, so they
never silently go unrun. Skipped without Triton.
"""

from __future__ import annotations

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

from mstar.engine.page_pool import PagePool  # noqa: E402
from mstar.layers import triton_attention  # noqa: E402
from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.whisper.cross_kv import (  # noqa: E402
    CrossAttentionBatch,
    CrossKVSlots,
    cross_attention,
)
from tests.support.triton_interpreter import (
    DEVICE,
    REASON,
    index_interpreted_scalars,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

RUNNABLE = kernels_runnable(triton_attention)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

# fp32 products are exact ("ieee") in the kernels; bf16 on the GPU rounds P to 16 bits.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


if RUNNABLE and triton_attention.INTERPRET:
    index_interpreted_scalars()


@pytest.mark.slow  # a whole pytest process of its own
@pytest.mark.skipif(RUNNABLE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter() -> None:
    rerun_in_fresh_interpreter(__file__)


@runnable
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[1, 1, 1], [2, 1, 3]])
def test_triton_cross_attention_matches_torch(counts: list[int], dtype: torch.dtype) -> None:
    heads, head_dim = 4, 16
    cross = CrossKVSlots(1, 4, FRAMES, heads, head_dim, dtype, DEVICE)
    gen = torch.Generator().manual_seed(sum(counts))
    cross.layers[0][:, :4] = torch.randn(2, 4, FRAMES, heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([3, 0, 2], device=DEVICE)
    q = (torch.randn(sum(counts), heads, head_dim, generator=gen) * 0.5).to(DEVICE, dtype)
    batches = {backend: CrossAttentionBatch.build(slots, counts, frames=FRAMES, sink=cross.sink, backend=backend)
               for backend in ("torch", "triton")}
    want = cross_attention(q, cross.layers[0], batches["torch"])
    before = cross.layers[0][:, :4].clone()
    got = cross_attention(q, cross.layers[0], batches["triton"])
    assert got.dtype == dtype and rel_err(got, want) <= TOL[dtype]
    assert torch.equal(cross.layers[0][:, :4], before)  # the kernel's writes land in the sink only


@runnable
def test_triton_decoder_matches_torch_over_prefill_and_decodes() -> None:
    """A mixed prefill, then decodes of sequences at different lengths, through ``decode``
    with each backend on twin caches (float32)."""
    model = tiny_model(DEVICE)
    layers, heads, head_dim = model.kv_layout()
    cross, slot = written_slots(model, DEVICE)
    caches = {b: allocate_kv_cache(layers, 16, PAGE_SIZE, heads, head_dim, torch.float32, DEVICE)
              for b in ("torch", "triton")}
    pools = {b: PagePool(16, PAGE_SIZE) for b in caches}
    gen = torch.Generator().manual_seed(8)
    steps = mixed_steps()
    for chunks in steps:
        ids = torch.randint(0, SOT, (sum(end - start for _, start, end in chunks),), generator=gen).to(DEVICE)
        counts = [end - start for _, start, end in chunks]
        slots = torch.tensor([slot[r] for r, _, _ in chunks], device=DEVICE)
        hidden = {}
        for backend in caches:
            meta = step_meta(pools[backend], chunks, backend, DEVICE)
            batch = CrossAttentionBatch.build(slots, counts, frames=FRAMES, sink=cross.sink, backend=backend)
            with torch.no_grad():
                hidden[backend] = model.decode(ids, meta, caches[backend], cross.layers, batch)
        err = rel_err(hidden["triton"], hidden["torch"])
        assert err <= TOL[torch.float32], (chunks, err)


@runnable
def test_graph_runner_on_triton_matches_eager_triton() -> None:
    """The bucketed runner (a CUDA graph on the GPU, eager buffers on the CPU) with the Triton
    backend against eager Triton decodes."""
    compare_graph_runner(tiny_model(DEVICE), "triton", DEVICE, torch.float32, tol=TOL[torch.float32])
