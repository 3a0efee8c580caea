"""The autoregressive engine's per-step host work: batch metadata built per row (a
prefill's positions and slots by tensor ops) must equal the slot-by-slot definition, and
decoding through the paged cache must pick the tokens a fresh prefill of the whole
sequence picks."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.registry import model_class

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = parse_config({
        "model": "llama", "model_path": str(tiny_llama_dir(tmp_path_factory.mktemp("ar"))), "load_format": "dummy",
        "device": "cpu", "dtype": "float32", "max_seq_len": 96, "max_concurrent_requests": 4,
        "resources": {"kv_cache": {"max_num_pages": 64, "page_size": PAGE_SIZE}},
    }, "test")
    return model_class("llama")(config).build_engines({"llm"}, torch.device("cpu"))["llm"]


def _prefill(rid: str, prompt: list[int], max_new: int = 50) -> EngineItem:
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": max_new, "stop_token_ids": []}
    return EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompt)}, params)


def test_metadata_matches_slot_by_slot(engine):
    pool = engine.pool
    pool.reserve("a", 11)  # 3 pages
    pool.reserve("b", 2)
    pool.reserve("c", 7)
    spans = [("a", 10, 11), ("b", 0, 2), ("c", 3, 7)]  # a decode, a prefill, a chunk of one
    ids = [7, 8, 9, 1, 2, 3, 4]
    try:
        for chosen in (spans, spans[:1], [("a", 10, 11), ("c", 6, 7)]):
            count = sum(end - start for _, start, end in chosen)
            meta, input_ids = engine._metadata(chosen, ids[:count])
            positions = [p for _, start, end in chosen for p in range(start, end)]
            assert meta.positions.tolist() == positions
            assert meta.slot_mapping.tolist() == [pool.slot(rid, p) for rid, start, end in chosen
                                                  for p in range(start, end)]
            starts = [0]
            for _, start, end in chosen:
                starts.append(starts[-1] + end - start)
            assert meta.query_start_loc.tolist() == starts
            assert meta.seq_lens.tolist() == [end for _, _, end in chosen]
            width = max(len(pool.page_table(rid)) for rid, _, _ in chosen)
            assert meta.page_table.tolist() == [pool.page_table(rid) + [0] * (width - len(pool.page_table(rid)))
                                                for rid, _, _ in chosen]
            assert input_ids.tolist() == ids[:count]
            assert meta.query_starts == starts and meta.seq_lens_list == [end for _, _, end in chosen]
            # every part 16-byte aligned, whatever the step's sizes (Triton compiles per alignment)
            parts = (meta.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.page_table, input_ids)
            assert all(part.storage_offset() % 2 == 0 for part in parts)
    finally:
        for rid in "abc":
            pool.free(rid)


def test_cached_decode_picks_what_a_fresh_prefill_picks(engine):
    prompts = {"x": [3, 1, 4, 1, 5], "y": [9, 2, 6, 5, 3, 5, 8, 9, 7]}
    outs = engine.run([_prefill(rid, p) for rid, p in prompts.items()])
    history = {rid: p + [int(o.outputs["token"])] for (rid, p), o in zip(prompts.items(), outs)}
    for _ in range(10):
        items = [EngineItem(rid, "decode", 0, {"token": torch.tensor([h[-1]])}, {}) for rid, h in history.items()]
        for h, out in zip(history.values(), engine.run(items)):
            h.append(int(out.outputs["token"]))
    for rid in prompts:
        engine.release(rid)
    assert engine.pool.num_used_pages == 0
    for rid, h in history.items():
        for cut in (len(prompts[rid]) + 3, len(h) - 1):
            fresh = engine.run([_prefill(f"{rid}-fresh", h[:cut])])[0]
            engine.release(f"{rid}-fresh")
            assert int(fresh.outputs["token"]) == h[cut], (rid, cut)


def test_failed_batch_leaves_the_engine_consistent(engine):
    """A batch that fails on one item raises that item's error, keeps no half-made state,
    and every item then runs alone (as the worker retries it)."""
    good = engine.run([_prefill("g", [1, 2, 3])])[0].outputs["token"]
    bad_first = _prefill("n", [])  # an empty prompt fails the batch after "g" was admitted
    with pytest.raises(ValueError, match="empty prompt"):
        engine.run([EngineItem("g", "decode", 0, {"token": good}, {}), bad_first])
    assert "n" not in engine.seqs and not engine.pool.has("n")
    assert engine.pool.seq_len("g") == len(engine.seqs["g"].tokens) - 1
    engine.run([EngineItem("g", "decode", 0, {"token": good}, {})])
    engine.release("g")
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0
