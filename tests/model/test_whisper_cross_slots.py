"""Whisper's fixed-shape cross-attention K/V slots, the batched cross-attention over them, and
the bucketed decode-graph path run eagerly on the CPU (against the eager engine).

Tiny random models in float32; the helpers here are shared with test_whisper_triton.py and
test_whisper_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mstar.config import ConfigError, parse_config
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.cuda_graphs import DecodeGraphs
from mstar.engine.page_pool import PagePool
from mstar.engine.state_pool import OutOfSlots
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.whisper import WhisperConfig, WhisperForConditionalGeneration
from mstar.model.whisper import cross_kv as cross_kv_module
from mstar.model.whisper.cross_kv import (
    CrossAttentionBatch,
    CrossKVSlots,
    cross_attention,
)
from mstar.model.whisper.engine import (
    CrossAttentionForward,
    EncoderGraphs,
    whisper_decoder_engine,
)
from mstar.model.whisper.rules import DecoderTokens

FRAMES = 24  # encoder positions of the tiny model (real Whisper: 1500)
PAGE_SIZE = 4
SOT = 100
TOKENS = DecoderTokens(vocab_size=120, eot=99, sot=SOT, no_timestamps=105, transcribe=103, translate=104,
                       language_ids=(101, 102), suppress=(7, 8), begin_suppress=(9,))
TINY = dict(vocab_size=120, num_mel_bins=8, d_model=32, encoder_layers=1, encoder_attention_heads=4,
            decoder_layers=2, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=FRAMES, max_target_positions=64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def tiny_model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> WhisperForConditionalGeneration:
    """Random weights large enough that attention is far from uniform."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = WhisperForConditionalGeneration(WhisperConfig(**TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_()
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.5 / math.sqrt(p[0].numel()))
    return model.to(dtype).eval()


def features(n: int, seed: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``n`` random audio-feature tensors ``[FRAMES, d_model]`` (what the encoder node sends)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(FRAMES, TINY["d_model"], generator=gen).to(device) for _ in range(n)]


def tiny_engine(model, *, max_requests: int = 4, num_pages: int = 48, backend: str = "torch",
                cuda_graphs: bool = False, graph_batch_sizes=(1, 2, 4), **kwargs) -> AutoregressiveEngine:
    device = next(model.parameters()).device
    return whisper_decoder_engine(
        model, TOKENS, layout=KVLayout(*model.kv_layout()), num_pages=num_pages, page_size=PAGE_SIZE,
        max_seq_len=TINY["max_target_positions"], device=device, dtype=next(model.parameters()).dtype,
        max_requests=max_requests, attention_backend=backend, cuda_graphs=cuda_graphs,
        graph_batch_sizes=graph_batch_sizes, **kwargs)


def prefill(request_id: str, audio: torch.Tensor, prompt: list[int], new_tokens: int = 40) -> EngineItem:
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": new_tokens, "stop_token_ids": []}
    inputs = {"prompt_ids": torch.tensor(prompt), "audio_features": audio}
    return EngineItem(request_id, "prefill", 0, inputs, params)


def drive(engine: AutoregressiveEngine, audio: dict[str, torch.Tensor], prompts: dict[str, list[int]],
          steps: list[list[str]]) -> dict[str, list[int]]:
    """Run ``steps`` (request ids per batch; a request's first step is its prefill) and return
    every request's generated tokens; requests absent from the rest of the schedule are released."""
    out: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        items = [prefill(r, audio[r], prompts[r]) if r not in out else
                 EngineItem(r, "decode", len(out[r]), {"token": torch.tensor([out[r][-1]])}, {})
                 for r in step]
        for r, result in zip(step, engine.run(items)):
            out.setdefault(r, []).append(int(result.outputs["token"]))
        for r in out:
            if engine.forward.cross_slots.has(r) and not any(r in later for later in steps[i + 1:]):
                engine.release(r)
    return out


# ------------------------------------------------------------------------------- slots
def test_slots_are_taken_at_prefill_written_once_and_freed() -> None:
    model = tiny_model()
    engine = tiny_engine(model, max_requests=2)
    slots = engine.forward.cross_slots
    audio = dict(zip("abc", features(3, seed=1)))
    assert slots.held() == {} and engine.stats()["cross_kv_slots_total"] == 2
    engine.run([prefill("a", audio["a"], [SOT, 101]), prefill("b", audio["b"], [SOT])])
    held = slots.held()
    assert sorted(held) == ["a", "b"] and sorted(held.values()) == [0, 1]
    with torch.no_grad():
        for layer, (keys, values) in enumerate(model.cross_kv(audio["b"])):
            assert torch.equal(slots.layers[layer][0][held["b"]], keys)
            assert torch.equal(slots.layers[layer][1][held["b"]], values)

    # exhausted: the third request fails alone, holding nothing afterwards
    with pytest.raises(OutOfSlots, match="cross-attention K/V slot; all 2"):
        engine.run([prefill("c", audio["c"], [SOT])])
    assert "c" not in engine.seqs and not engine.pool.has("c") and sorted(slots.held()) == ["a", "b"]

    engine.release("a")
    assert sorted(slots.held()) == ["b"] and engine.stats()["cross_kv_slots_used"] == 1
    engine.run([prefill("c", audio["c"], [SOT])])
    assert slots.held()["c"] == held["a"]  # a's slot, now c's

    # a first step that fails after taking its slot gives it back
    engine.release("b")
    bad = prefill("d", torch.zeros(FRAMES, TINY["d_model"] + 1), [SOT])
    with pytest.raises(RuntimeError):
        engine.run([bad])
    assert sorted(slots.held()) == ["c"] and "d" not in engine.seqs
    engine.release("c")
    assert slots.held() == {} and engine.pool.num_used_pages == 0
    slots.pool.check_invariants()


def test_slots_that_do_not_fit_are_refused_naming_the_key() -> None:
    # whisper-large-v3 cross K/V (32 layers, 1500 frames, 20 x 64, bf16): 246 MiB a slot
    with pytest.raises(ValueError, match=r"max_concurrent_requests \(1000000\) does not fit"):
        CrossKVSlots(32, 1_000_000, 1500, 20, 64, torch.bfloat16, "cpu")


def test_deployment_refuses_slots_beyond_free_memory(tmp_path, monkeypatch) -> None:
    from benchmarks.common import WHISPER_TINY, whisper_dir
    from mstar.runtime.launch import start

    monkeypatch.setattr(cross_kv_module, "free_memory_bytes", lambda device: 2**20)
    config = parse_config({"model": "whisper", "model_path": str(whisper_dir(tmp_path, **WHISPER_TINY)),
                           "load_format": "dummy", "max_concurrent_requests": 3})
    with pytest.raises(ConfigError, match=r"max_concurrent_requests \(3\).*lower max_concurrent_requests"):
        start(config, in_process=True)


@pytest.mark.parametrize("kwargs,message", [
    ({}, None),
    ({"cuda_graphs": True}, "model_kwargs.cuda_graphs needs device: cuda"),
    ({"cuda_graphs": "yes"}, "model_kwargs.cuda_graphs: must be true or false"),
    ({"attention_backend": "flash"}, "model_kwargs.attention_backend: must be 'torch' or 'triton'"),
    ({"cuda_graph_batch_sizes": [1, 0]}, r"model_kwargs.cuda_graph_batch_sizes\[1\]: must be >= 1"),
    ({"overlap_scheduling": 1}, "model_kwargs.overlap_scheduling: must be true or false"),
    ({"fused_kernels": "on"}, "model_kwargs.fused_kernels: must be true or false"),
    ({"encoder_cuda_graphs": True}, "model_kwargs.encoder_cuda_graphs needs device: cuda"),
    ({"encoder_cuda_graphs": None}, "model_kwargs.encoder_cuda_graphs: must be true or false"),
])
def test_fast_path_switches_are_checked_at_startup(tmp_path, kwargs, message) -> None:
    """Every switch is checked when the spec is made, before anything loads."""
    from benchmarks.common import WHISPER_TINY, whisper_dir
    from mstar.model.whisper.engine import decoder_switches
    from mstar.model.whisper.model import Whisper

    config = parse_config({"model": "whisper", "model_path": str(whisper_dir(tmp_path, **WHISPER_TINY)),
                           "load_format": "dummy", "model_kwargs": kwargs})
    if message is None:
        knobs = Whisper(config).knobs
        assert decoder_switches(knobs) == {"attention_backend": "torch", "overlap_scheduling": False}
        assert not knobs.fused_kernels and not knobs.encoder_cuda_graphs
        return
    with pytest.raises(ConfigError, match=message):
        Whisper(config)


# ------------------------------------------------------------------ batched cross-attention
def per_request_reference(q: torch.Tensor, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                          slots: list[int], counts: list[int]) -> torch.Tensor:
    """The path the slots replaced: one SDPA per request over its own K/V ``[S, H, Dh]``."""
    out, start = torch.empty_like(q), 0
    for slot, n in zip(slots, counts):
        keys, values = kv[slot]
        out[start:start + n] = F.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            scale=1.0).transpose(0, 1)
        start += n
    return out


@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1], [1, 3, 1, 2, 1], [4], [2, 5]])
def test_batched_cross_attention_equals_per_request_path(counts: list[int]) -> None:
    heads, head_dim = 4, 16
    slots_buffer = CrossKVSlots(1, 6, FRAMES, heads, head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(len(counts))
    kv = {}
    for slot in range(6):
        kv[slot] = (2 * torch.randn(FRAMES, heads, head_dim, generator=gen),
                    torch.randn(FRAMES, heads, head_dim, generator=gen))
        slots_buffer.layers[0][0][slot], slots_buffer.layers[0][1][slot] = kv[slot]
    slots = [5, 0, 3, 1, 4][: len(counts)]  # requests at different steps, slots out of order
    q = torch.randn(sum(counts), heads, head_dim, generator=gen) * head_dim**-0.5
    batch = CrossAttentionBatch.build(torch.tensor(slots), counts, frames=FRAMES, sink=slots_buffer.sink,
                                      backend="torch")
    assert (batch.token_seq is None) == all(n == 1 for n in counts)
    got = cross_attention(q, slots_buffer.layers[0], batch)
    err = rel_err(got, per_request_reference(q, kv, slots, counts))
    assert err <= 1e-6, err


# --------------------------------------------------------- decode graphs, run eagerly on the CPU
def written_slots(model: WhisperForConditionalGeneration, device) -> tuple[CrossKVSlots, dict[str, int]]:
    """Three slots holding the cross K/V of requests "a", "b" and "c" (float32), and which
    slot each has."""
    layers, heads, head_dim = model.kv_layout()
    cross = CrossKVSlots(layers, 3, FRAMES, heads, head_dim, torch.float32, device)
    slot = {"a": 2, "b": 0, "c": 1}
    with torch.no_grad():
        model.write_cross_kv(torch.stack(features(3, seed=7, device=device)),
                             torch.tensor(list(slot.values()), device=device), cross.layers)
    return cross, slot


def mixed_steps() -> list[list[tuple[str, int, int]]]:
    """Spans ``(request, start, end)`` of a prefill of three sequences (5, 1 and 3 tokens),
    then three decode steps in shifting orders."""
    lens = {"a": 5, "b": 1, "c": 3}
    steps = [[(r, 0, n) for r, n in lens.items()]]
    for order in (["c", "a", "b"], ["b", "c"], ["a", "b", "c"]):
        steps.append([(r, lens[r], lens[r] + 1) for r in order])
        for r in order:
            lens[r] += 1
    return steps


def step_meta(pool: PagePool, chunks: list[tuple[str, int, int]], backend: str,
              device: torch.device | str = "cpu") -> PagedAttentionMetadata:
    """Metadata for ``(seq, start, end)`` new-token ranges (pages reserved up to ``end``)."""
    positions, slots, starts, seq_lens, tables = [], [], [0], [], []
    for seq, start, end in chunks:
        pool.reserve(seq, end)
        positions += range(start, end)
        slots += pool.slots(seq, start, end)
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
        tables.append(pool.page_table(seq))
    width = max(map(len, tables))
    table = [t + [0] * (width - len(t)) for t in tables]

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedAttentionMetadata(ints(positions), ints(slots), ints(starts), ints(seq_lens), ints(table),
                                  PAGE_SIZE, backend)


def compare_graph_runner(model, backend: str, device: torch.device | str, dtype: torch.dtype, tol: float) -> None:
    """Decode steps of 3, 4, 1 and 2 sequences (buckets 4, 4, 1, 2) through the decode graphs
    of Whisper's forward (each row's cross slot a graph input) and through eager ``decode`` on
    twin caches: same hidden states, same K/V in every real page."""
    layers, heads, head_dim = model.kv_layout()
    num_pages = 40
    eager_kv = allocate_kv_cache(layers, num_pages + 1, PAGE_SIZE, heads, head_dim, dtype, device)
    forward = CrossAttentionForward(model, max_requests=5, dtype=dtype, device=torch.device(device),
                                    attention_backend=backend)
    cross = forward.cross_slots
    runner_kv = [c.clone() for c in eager_kv]
    graphs = DecodeGraphs(lambda ids, meta, rows: forward.graph_step(ids, meta, runner_kv, rows),
                          device=torch.device(device), page_size=PAGE_SIZE, max_pages_per_seq=16,
                          scratch_page=num_pages, batch_sizes=(1, 2, 4), backend=backend,
                          row_pads=forward.graph_rows)
    pool = PagePool(num_pages, PAGE_SIZE)
    names = ["a", "b", "c", "d"]
    slot = {r: cross.acquire(r) for r in ["x", *names]}  # x only shifts the slots
    with torch.no_grad():
        model.write_cross_kv(torch.stack(features(4, seed=3, device=device)).to(dtype),
                             torch.tensor([slot[r] for r in names], device=device), cross.layers)
    lens = {"a": 3, "b": 1, "c": 5, "d": 2}
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the prompts, eagerly into both caches
        chunks = [(r, 0, n) for r, n in lens.items()]
        meta = step_meta(pool, chunks, backend, device)
        ids = torch.randint(0, SOT, (sum(lens.values()),), generator=gen).to(device)
        batch = CrossAttentionBatch.build(torch.tensor([slot[r] for r in names], device=device),
                                          list(lens.values()), frames=FRAMES, sink=cross.sink, backend=backend)
        for caches in (eager_kv, runner_kv):
            model.decode(ids, meta, caches, cross.layers, batch)
    for step in (["c", "a", "d"], ["a", "b", "c", "d"], ["b"], ["d", "a"], ["c", "a", "d"]):
        meta = step_meta(pool, [(r, lens[r], lens[r] + 1) for r in step], backend, device)
        for r in step:
            lens[r] += 1
        ids = torch.randint(0, SOT, (len(step),), generator=gen).to(device)
        slots = torch.tensor([slot[r] for r in step], device=device)
        with torch.no_grad():
            batch = CrossAttentionBatch.build(slots, None, frames=FRAMES, sink=cross.sink, backend=backend)
            want = model.decode(ids, meta, eager_kv, cross.layers, batch)
            got = graphs.run(ids, meta, {"cross_slots": slots})
        assert got.shape == want.shape
        err = rel_err(got, want)
        assert err <= tol, (step, err)
    assert graphs.captured_batch_sizes == (1, 2, 4)
    used = torch.tensor(sorted(p for r in names for p in pool.page_table(r)), device=device)
    for e, g in zip(eager_kv, runner_kv):
        assert rel_err(g[:, used], e[:, used]) <= tol
        assert torch.count_nonzero(g[:, num_pages]) > 0  # the padded rows wrote the scratch page only


def test_graph_runner_matches_eager_decode_on_cpu() -> None:
    compare_graph_runner(tiny_model(), "torch", "cpu", torch.float32, tol=1e-6)


def test_engine_with_decode_graphs_matches_eager_engine() -> None:
    """The same schedule (batches of 1-4 decodes, prefills joining, requests leaving) through an
    engine with the bucketed graph path (run eagerly here) and one without: same tokens."""
    model = tiny_model()
    audio = dict(zip("abcd", features(4, seed=5)))
    prompts = {"a": [SOT, 101, 103, 105], "b": [SOT], "c": [SOT, 102], "d": [SOT, 101, 103]}
    steps = [["a", "b"], ["a", "b", "c"], ["b", "a", "c"], ["c", "a", "b", "d"], ["d", "c", "a"],
             ["a", "d"], ["d"], ["d", "a"], ["a"]]
    eager = tiny_engine(model)
    graphed = tiny_engine(model, cuda_graphs=True)
    assert graphed.stats()["kv_pages_total"] == eager.stats()["kv_pages_total"] == 48
    want = drive(eager, audio, prompts, steps)
    got = drive(graphed, audio, prompts, steps)
    assert got == want
    assert graphed.graphs is not None and graphed.graphs.captured_batch_sizes == (1, 2, 4)
    assert graphed.forward.cross_slots.held() == {} and graphed.stats()["kv_pages_used"] == 0


def test_switches_reach_the_engines(tmp_path, monkeypatch) -> None:
    """overlap_scheduling reaches the decoder engine; fused_kernels the model (on the CPU only
    under Triton's interpreter, refused otherwise)."""
    from benchmarks.common import WHISPER_TINY, whisper_dir
    from mstar.model.whisper.model import Whisper

    path = str(whisper_dir(tmp_path, **WHISPER_TINY))
    spec = Whisper(parse_config({"model": "whisper", "model_path": path, "load_format": "dummy",
                                 "model_kwargs": {"overlap_scheduling": True}}))
    spec.load_frontend()
    engines = spec.build_engines({"encoder", "decoder"}, torch.device("cpu"))
    assert engines["decoder"].overlap and not engines["decoder"].model.model.decoder.fused_kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="model_kwargs.fused_kernels needs device: cuda"):
        Whisper(parse_config({"model": "whisper", "model_path": path, "load_format": "dummy",
                              "model_kwargs": {"fused_kernels": True}}))


def test_encoder_graphs_pad_to_buckets_on_cpu() -> None:
    """The encoder's bucketed path (eager on the CPU): zero-padded rows dropped, the same
    features as ``encode``; a batch past the buckets runs eagerly."""
    model = tiny_model()
    graphs = EncoderGraphs(model, (1, 4))
    gen = torch.Generator().manual_seed(6)
    mel = torch.randn(5, TINY["num_mel_bins"], 2 * FRAMES, generator=gen)
    with torch.no_grad():
        want = model.encode(mel)
    for rows in ([0], [1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]):
        got = graphs.run(mel[rows])
        assert got.shape == want[rows].shape and rel_err(got, want[rows]) <= 1e-6
    assert graphs.captured_batch_sizes == (1, 4)
