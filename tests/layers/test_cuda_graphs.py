"""The CUDA-graph runner (``mstar.engine.cuda_graphs``): decode steps replayed per bucket,
and the Triton backend, on the GPU; the same buckets, padding and keys run eagerly on the CPU.

The GPU tests are skipped without CUDA (or Triton).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.cuda_graphs import BucketGraphs, DecodeGraphs, ShapeGraphs
from mstar.engine.forward import Forward
from mstar.engine.page_pool import PagePool
from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.llama import LlamaConfig, LlamaForCausalLM
from tests.support.markers import needs_cuda

# Not imported here: on CPU, test_triton_attention must be first to import triton (after
# setting TRITON_INTERPRET).
HAS_TRITON = importlib.util.find_spec("triton") is not None


PAGE_SIZE = 16
NUM_PAGES = 64  # the last one is the graph runner's scratch page
MAX_PAGES = 8


def tiny_llama(device: torch.device | str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(param, 0.5, 1.5)
    return model.to(dtype).eval()


def step_meta(pool: PagePool, chunks: list[tuple[str, int, int]], device: torch.device,
              backend: str = "torch") -> PagedAttentionMetadata:
    """Metadata for ``(seq, start, end)`` new-token ranges (pages reserved up to ``end``)."""
    positions, slots, starts, seq_lens, tables = [], [], [0], [], []
    for seq, start, end in chunks:
        pool.reserve(seq, end)
        positions += range(start, end)
        slots += pool.slots(seq, start, end)
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
        tables.append(pool.page_table(seq))
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for row, pages in enumerate(tables):
        table[row, : len(pages)] = torch.tensor(pages)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedAttentionMetadata(ints(positions), ints(slots), ints(starts), ints(seq_lens),
                                  table.to(device), pool.page_size, backend)


def eager_and_graphed_step(model, lens: dict[str, int], prompt: torch.Tensor, tokens: torch.Tensor,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode step of ``tokens`` after prefilling ``prompt`` (the sequences
    ``lens``, in a fresh cache and pool), eagerly and from a CUDA graph captured on the spot,
    with the Triton attention."""
    caches = allocate_kv_cache(2, 256, 4, 2, 64, torch.bfloat16, device)
    pool = PagePool(255, 4)
    model(prompt, step_meta(pool, [(s, 0, n) for s, n in lens.items()], device, "triton"), caches)
    meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], device, "triton")
    eager = model.compute_logits(model(tokens, meta, caches))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = model.compute_logits(model(tokens, meta, caches))
    graph.replay()
    torch.cuda.synchronize()
    return eager.clone(), graphed.clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def decode_graphs(model, caches: list[torch.Tensor], page_size: int, max_pages: int, batch_sizes,
                  backend: str = "triton") -> DecodeGraphs:
    """A plain decoder's decode steps (logits) as per-bucket replays over ``caches``, whose last
    page is the scratch page."""
    forward = Forward(model)
    return DecodeGraphs(lambda ids, meta, rows: forward.graph_step(ids, meta, caches, rows),
                        device=caches[0].device, page_size=page_size, max_pages_per_seq=max_pages,
                        scratch_page=caches[0].shape[1] - 1, batch_sizes=batch_sizes, backend=backend)


@needs_cuda(triton=True)
def test_graph_decode_matches_eager() -> None:
    device = torch.device("cuda")
    model = tiny_llama(device, torch.bfloat16)
    caches = allocate_kv_cache(2, NUM_PAGES, PAGE_SIZE, 2, 64, torch.bfloat16, device)
    graph_caches = [c.clone() for c in caches]
    runner = decode_graphs(model, graph_caches, PAGE_SIZE, MAX_PAGES, batch_sizes=(1, 2, 4, 8, 16, 32))
    rng = random.Random(0)
    with torch.inference_mode():
        for batch in (1, 3, 17):
            pool = PagePool(NUM_PAGES - 1, PAGE_SIZE)
            lens = {f"s{i}": rng.randint(1, 40) for i in range(batch)}
            prompt = torch.randint(0, 512, (sum(lens.values()),), device=device)
            meta = step_meta(pool, [(s, 0, n) for s, n in lens.items()], device)
            model(prompt, meta, caches)
            for layer, cache in enumerate(caches):
                graph_caches[layer].copy_(cache)
            for _ in range(2):  # two steps: the second replays with updated buffers
                tokens = torch.randint(0, 512, (batch,), device=device)
                meta = step_meta(pool, [(s, n, n + 1) for s, n in lens.items()], device)
                eager = model.compute_logits(model(tokens, meta, caches))
                graphed = runner.run(tokens, replace(meta, backend="triton"))
                assert graphed.shape == eager.shape
                assert rel_err(graphed, eager) < 2e-2, (batch, rel_err(graphed, eager))
                lens = {s: n + 1 for s, n in lens.items()}
                for cache, graph_cache in zip(caches, graph_caches):
                    real = slice(0, NUM_PAGES - 1)  # the scratch page differs, by design
                    assert rel_err(graph_cache[:, real], cache[:, real]) < 2e-2
    assert runner.captured_batch_sizes == (1, 4, 32)


@needs_cuda(triton=True)
@pytest.mark.parametrize("chunks", [[(1, 300), (1, 17), (1, 1000), (1, 64)], [(37, 0), (1, 500), (80, 200)]],
                         ids=["decode", "mixed"])
def test_triton_backend_matches_torch_on_gpu(chunks: list[tuple[int, int]]) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    pool = PagePool(512, PAGE_SIZE)
    meta = step_meta(pool, [(f"s{i}", old, old + new) for i, (new, old) in enumerate(chunks)], device)
    tokens = meta.positions.shape[0]
    q = torch.randn(tokens, 32, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(2, 512, PAGE_SIZE, 8, 128, device=device, dtype=torch.bfloat16)
    ref_cache = cache.clone()
    ref = paged_attention(q, k, v, ref_cache, meta, 128**-0.5)
    out = paged_attention(q, k, v, cache, replace(meta, backend="triton"), 128**-0.5)
    assert torch.equal(cache, ref_cache)
    assert rel_err(out, ref) < 2e-2


@needs_cuda(triton=True)
def test_engine_with_graph_runner_generates_like_eager() -> None:
    device = torch.device("cuda")
    model = tiny_llama(device, torch.float32)
    layout = KVLayout(2, 2, 64)
    engines = [
        AutoregressiveEngine(model, layout, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_seq_len=128,
                             device=device, dtype=torch.float32),
        AutoregressiveEngine(model, layout, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_seq_len=128,
                             device=device, dtype=torch.float32, cuda_graphs=True, graph_batch_sizes=(1, 2, 4),
                             attention_backend="triton"),
    ]
    assert engines[1].pool.num_pages == NUM_PAGES  # the scratch page is an extra one
    assert engines[1].kv_caches[0].shape[1] == NUM_PAGES + 1
    prompts = {"a": [5, 6, 7], "b": list(range(40, 73)), "c": [9]}
    histories = [generate(engine, prompts, steps=6) for engine in engines]
    assert histories[0] == histories[1]
    assert engines[1].graphs.captured_batch_sizes == (4,)


def generate(engine: AutoregressiveEngine, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    params: dict[str, Any] = {"sampling": {"temperature": 0.0}}
    items = [EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(p)}, params) for rid, p in prompts.items()]
    out = {rid: [int(o.outputs["token"])] for rid, o in zip(prompts, engine.run(items))}
    for step in range(1, steps):
        items = [EngineItem(rid, "decode", step, {"token": torch.tensor([t[-1]])}, params) for rid, t in out.items()]
        for rid, o in zip(out, engine.run(items)):
            out[rid].append(int(o.outputs["token"]))
    return out


def test_engine_with_decode_graphs_on_cpu() -> None:
    """The bucketed decode path run eagerly (off CUDA nothing is captured): the same tokens
    as the engine without it, every decode step through a bucket, padded rows touching only
    the scratch page past the pool's pages."""
    model = tiny_llama("cpu", torch.float32)
    layout = KVLayout(2, 2, 64)
    kwargs: dict[str, Any] = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_seq_len=128,
                                  device=torch.device("cpu"), dtype=torch.float32)
    plain = AutoregressiveEngine(model, layout, **kwargs)
    graphed = AutoregressiveEngine(model, layout, cuda_graphs=True, graph_batch_sizes=(1, 4), **kwargs)
    assert plain.pool.num_pages == graphed.pool.num_pages == NUM_PAGES
    assert graphed.kv_caches[0].shape[1] == NUM_PAGES + 1
    prompts = {"a": [1, 2, 3], "b": list(range(10, 30)), "c": [7, 8]}
    assert generate(plain, prompts, 4) == generate(graphed, prompts, 4)
    assert graphed.graphs.captured_batch_sizes == (4,)  # three rows: bucket 4, one padded
    assert torch.count_nonzero(graphed.kv_caches[0][:, NUM_PAGES]) > 0  # the padded row's K/V
    with pytest.raises(ValueError, match="unknown attention backend"):
        AutoregressiveEngine(model, layout, attention_backend="nope", **kwargs)


def test_decode_graphs_take_row_inputs_of_any_width() -> None:
    """A per-row input given as a row tensor (the duplex LLM's input embedding) gets a buffer
    of that row's shape and dtype; padded rows hold the given row, index inputs their int."""
    seen: list[dict[str, torch.Tensor]] = []

    def step(ids: torch.Tensor, meta: PagedAttentionMetadata, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append({name: value.clone() for name, value in rows.items()})
        return rows["embeds"].sum(-1) + rows["slot"]

    pad = torch.tensor([0.5, 0.0, -1.0], dtype=torch.float64)
    graphs = DecodeGraphs(step, device=torch.device("cpu"), page_size=PAGE_SIZE, max_pages_per_seq=2,
                          scratch_page=9, batch_sizes=(4,), backend="torch", row_pads={"slot": 7, "embeds": pad})
    pool = PagePool(8, PAGE_SIZE)
    meta = step_meta(pool, [("a", 3, 4), ("b", 0, 1)], torch.device("cpu"))
    embeds = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    out = graphs.run(torch.tensor([5, 6]), meta, {"slot": torch.tensor([1, 2]), "embeds": embeds})
    assert out.tolist() == [7.0, 17.0]
    assert seen[-1]["embeds"].dtype == torch.float64
    assert seen[-1]["embeds"].tolist() == [*embeds.tolist(), pad.tolist(), pad.tolist()]
    assert seen[-1]["slot"].tolist() == [1, 2, 7, 7]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda(triton=True))])
def test_prefill_graphs_generate_like_eager(device: str) -> None:
    """A request's whole prompt alone in a step replays a prefill graph per token bucket (off
    CUDA the same buckets run eagerly): the same tokens as the engine without graphs, at
    prompt lengths inside, at and past the buckets; a step of two prompts, a prompt past the
    last bucket and a one-token prompt run as before. The padded tokens write only the scratch
    page."""
    dev = torch.device(device)
    model = tiny_llama(dev, torch.float32)
    layout = KVLayout(2, 2, 64)
    backend = "triton" if device == "cuda" else "torch"
    kwargs: dict[str, Any] = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_seq_len=128, device=dev,
                                  dtype=torch.float32, attention_backend=backend)
    plain = AutoregressiveEngine(model, layout, **kwargs)
    graphed = AutoregressiveEngine(model, layout, cuda_graphs=True, graph_batch_sizes=(1, 2),
                                   prefill_graph_tokens=(16, 32), **kwargs)
    assert graphed.prefill_graphs is not None and plain.prefill_graphs is None
    rng = random.Random(3)
    for i, length in enumerate((5, 16, 17, 32, 40, 1)):
        prompt = {f"r{i}": [rng.randrange(1, 200) for _ in range(length)]}
        assert generate(plain, prompt, 3) == generate(graphed, prompt, 3), length
        for engine in (plain, graphed):
            engine.release(f"r{i}")
    pair = {"p": [3, 4, 5, 6], "q": [7, 8, 9]}
    assert generate(plain, pair, 3) == generate(graphed, pair, 3)
    assert graphed.prefill_graphs.captured_token_sizes == (16, 32)
    assert torch.count_nonzero(graphed.kv_caches[0][:, NUM_PAGES]) > 0  # the padded tokens' K/V


def test_bucket_graphs_pad_and_copy_out() -> None:
    """Rows past the batch hold the pads; an input narrower than its buffer fills the leading
    columns, zeros after; the output is a copy of the batch's rows."""
    seen: list[dict[str, torch.Tensor]] = []

    def step(rows: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append({name: value.clone() for name, value in rows.items()})
        return rows["table"].sum(-1) + rows["ids"]

    buffers = {"ids": torch.zeros(4, dtype=torch.int64), "table": torch.zeros(4, 3, dtype=torch.int64)}
    graphs = BucketGraphs(step, buffers, {"ids": -1, "table": torch.tensor([9, 0, 0])}, (2, 4))
    out = graphs.run(3, {"ids": torch.tensor([1, 2, 3]), "table": torch.tensor([[5], [6], [7]])})
    assert out.tolist() == [6, 8, 10] and graphs.captured_batch_sizes == (4,)
    assert seen[-1]["ids"].tolist() == [1, 2, 3, -1]
    assert seen[-1]["table"].tolist() == [[5, 0, 0], [6, 0, 0], [7, 0, 0], [9, 0, 0]]
    graphs.run(1, {"ids": torch.tensor([4]), "table": torch.tensor([[1, 1, 1]])})
    assert seen[-1]["table"].tolist() == [[1, 1, 1], [9, 0, 0]] and graphs.captured_batch_sizes == (2, 4)
    with pytest.raises(ValueError, match="does not fit buckets"):
        graphs.run(5, {"ids": torch.zeros(5, dtype=torch.int64)})


def test_shape_graphs_keep_a_static_copy_per_key_and_a_bound() -> None:
    calls: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x * 2

    graphs = ShapeGraphs(fn, torch.device("cpu"), max_graphs=2)
    first = torch.ones(3)
    assert graphs((3,), first).tolist() == [2, 2, 2] and calls[-1] is not first  # a static copy
    assert graphs((3,), torch.full((3,), 5.0)).tolist() == [10, 10, 10]
    assert calls[-1] is calls[0]  # the same static input, refilled
    graphs((2,), torch.ones(2))
    third = torch.ones(4)
    assert graphs((4,), third).tolist() == [2] * 4 and calls[-1] is third  # past the bound: eager
    assert set(graphs.inputs) == {(3,), (2,)}
