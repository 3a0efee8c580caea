"""Prefix caching in the autoregressive engine: greedy outputs (fp32, CPU, a tiny Llama) are
the same with the cache on and off, whether requests sharing a prefix come one after another,
together, or while others decode, eagerly or with overlap scheduling; a hit skips the cached
tokens' computation; a disaggregated prefill hands off the same K/V from cached pages."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.forward import Forward
from mstar.model.llama.model import LLM, LLM_PREFILL, LlamaChat

PAGE_SIZE = 4
SYSTEM = [11, 250, 37, 4, 98, 120, 7, 64, 301, 5]  # two whole pages and two tokens
STEPS = 6


def _spec(path: str, **knobs) -> LlamaChat:
    return LlamaChat(parse_config({
        "model": "llama", "model_path": path, "load_format": "dummy", "device": "cpu", "dtype": "float32",
        "max_seq_len": 64, "max_concurrent_requests": 8, "model_kwargs": knobs,
        "resources": {"kv_cache": {"max_num_pages": 48, "page_size": PAGE_SIZE}},
    }, "test"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(tiny_llama_dir(tmp_path_factory.mktemp("prefix")))


@pytest.fixture(scope="module")
def engines(llama_dir):
    """The same weights under three engines: no cache (the reference), the cache, and the
    cache with overlap scheduling."""
    return {
        "off": _spec(llama_dir, prefix_caching=False).build_engines({LLM}, torch.device("cpu"))[LLM],
        "on": _spec(llama_dir).build_engines({LLM}, torch.device("cpu"))[LLM],
        "overlap": _spec(llama_dir, overlap_scheduling=True).build_engines({LLM}, torch.device("cpu"))[LLM],
    }


@pytest.fixture(autouse=True)
def _drained(engines):
    yield
    for engine in engines.values():
        for request_id in list(engine.seqs) + engine.pool.seq_ids():
            engine.release(request_id)
        engine.pool.check_invariants()
        assert engine.pool.num_used_pages == 0


def _prefill(rid: str, prompt: list[int], **inputs) -> EngineItem:
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": STEPS, "stop_token_ids": []}
    return EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompt), **inputs}, params)


def _serve(engine: AutoregressiveEngine, arrivals: list[tuple[int, str, list[int]]],
           logits: dict[str, list[torch.Tensor]] | None = None) -> dict[str, list[int]]:
    """Run requests arriving at the given steps (prefills batched with the live decodes) to
    ``STEPS`` tokens each; returns each request's tokens, and puts the logits each token was
    chosen from into ``logits``."""
    out: dict[str, list[int]] = {}
    last: dict[str, torch.Tensor] = {}
    choose = engine.rules.choose

    def recording(rows, seqs, sample, lead=0):
        for row, seq in zip(rows, seqs):
            logits.setdefault(seq.request_id, []).append(row.clone())
        return choose(rows, seqs, sample, lead)

    if logits is not None:
        engine.rules.choose = recording
    try:
        step = 0
        while step == 0 or last or any(at >= step for at, _, _ in arrivals):
            items = [EngineItem(rid, "decode", 0, {"token": token}, {}) for rid, token in last.items()]
            items += [_prefill(rid, prompt) for at, rid, prompt in arrivals if at == step]
            for item, result in zip(items, engine.run(items) if items else []):
                out.setdefault(item.request_id, []).append(int(result.outputs["token"]))
                last[item.request_id] = result.outputs["token"]
                if "stop" in result.flags:
                    del last[item.request_id]
                    engine.release(item.request_id)
            step += 1
    finally:
        engine.rules.__dict__.pop("choose", None)
    engine.pool.check_invariants()
    return out


SCENARIOS = {
    # one after another: each finds the system prompt (and the last one its whole prompt) cached
    "sequential": [(0, "a", SYSTEM + [3, 9]), (8, "b", SYSTEM + [40, 41, 42, 43, 44]), (16, "c", SYSTEM + [3, 9]),
                   (24, "short", [77, 78]), (32, "system", SYSTEM[:8]), (40, "again", SYSTEM[:9])],
    # together in one step: no hits among them, duplicates filed once
    "concurrent": [(0, rid, SYSTEM + tail) for rid, tail in (("a", [1]), ("b", [2, 2]), ("c", [1]), ("d", []))],
    # arriving while the others decode: prefills that hit, batched with decodes
    "staggered": [(0, "a", SYSTEM + [6]), (1, "b", SYSTEM + [6]), (2, "c", SYSTEM + [8, 8, 8]), (2, "d", [5]),
                  (4, "e", SYSTEM[:4] + [1, 2, 3, 4, 5])],
}


@pytest.fixture(scope="module")
def reference(engines):
    """Each scenario's tokens and logits without the cache, run once."""
    runs: dict[str, tuple[dict, dict]] = {}

    def of(scenario: str) -> tuple[dict, dict]:
        if scenario not in runs:
            logits: dict[str, list[torch.Tensor]] = {}
            runs[scenario] = _serve(engines["off"], SCENARIOS[scenario], logits), logits
        return runs[scenario]

    return of


@pytest.mark.parametrize("mode", ["on", "overlap"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(engines, reference, scenario, mode):
    engine = engines[mode]
    hits = engine.prefix_hits
    tokens, want = reference(scenario)
    got: dict[str, list[torch.Tensor]] = {}
    assert _serve(engine, SCENARIOS[scenario], got) == tokens
    assert got.keys() == want.keys()
    for rid in want:  # the tokens could agree by luck under random weights; the logits cannot
        torch.testing.assert_close(torch.stack(got[rid]), torch.stack(want[rid]), rtol=0, atol=1e-5, msg=rid)
    if scenario != "concurrent":
        assert engine.prefix_hits > hits
    assert engines["off"].pool.num_cached_pages == 0 and "prefix_cache_hit_tokens" not in engines["off"].stats()


def _computed_tokens(engine: AutoregressiveEngine, monkeypatch) -> list[int]:
    """Records how many positions each forward of the engine computes."""
    counts: list[int] = []
    hidden = engine.forward.hidden

    def counting(input_ids, *args, **kwargs):
        counts.append(input_ids.numel())
        return hidden(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.forward, "hidden", counting)
    return counts


@pytest.mark.parametrize(("prompt", "cached"), [(SYSTEM, 8), (SYSTEM[:9], 8), (SYSTEM[:8], 4), (SYSTEM[:3], 0)],
                         ids=["pages-and-a-half", "one-past-pages", "whole-pages", "under-a-page"])
def test_a_hit_computes_only_what_the_cache_lacks(engines, monkeypatch, prompt, cached):
    """At most all but the last token comes from the cache: the step computes the rest."""
    engine = engines["on"]
    engine.run([_prefill("first", SYSTEM + [1, 2])])
    engine.release("first")
    computed = _computed_tokens(engine, monkeypatch)
    queried, hits = engine.prefix_queried, engine.prefix_hits
    want = engines["off"].run([_prefill("ref", prompt)])[0].outputs["token"]
    got = engine.run([_prefill("again", prompt)])[0].outputs["token"]
    assert int(got) == int(want)
    assert computed == [len(prompt) - cached]
    assert engine.seqs["again"].computed == len(prompt)
    assert (engine.prefix_queried - queried, engine.prefix_hits - hits) == (len(prompt), cached)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == engine.prefix_hits and stats["kv_pages_cached"] >= 2


def test_generated_tokens_are_cached_for_the_next_turn(engines, monkeypatch):
    """A chat resends its history: the reply's whole pages were filed as they were computed."""
    engine = engines["on"]
    reply = _serve(engine, [(0, "turn1", SYSTEM)])["turn1"]
    history = SYSTEM + reply + [9, 9]  # 18 tokens, 15 of them computed in turn 1
    computed = _computed_tokens(engine, monkeypatch)
    want = _serve(engines["off"], [(0, "ref", history)])
    assert _serve(engine, [(0, "turn2", history)]) == {"turn2": want["ref"]}
    assert computed[0] == len(history) - 12  # three pages found, the rest computed


def test_a_prefill_with_inputs_besides_its_tokens_skips_the_cache(engines, monkeypatch):
    engine = engines["on"]
    engine.run([_prefill("first", SYSTEM)])
    computed = _computed_tokens(engine, monkeypatch)
    hits = engine.prefix_hits
    engine.run([_prefill("media", SYSTEM, pixels=torch.zeros(1))])
    assert computed == [len(SYSTEM)] and engine.prefix_hits == hits


def test_a_forward_with_state_beyond_the_tokens_refuses_the_cache(engines):
    class Stateful(Forward):
        kv_from_tokens = False

    model = engines["off"].model
    with pytest.raises(ValueError, match="prefix_caching: the K/V Stateful computes"):
        AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=4, page_size=4, max_seq_len=16,
                             device=torch.device("cpu"), dtype=torch.float32, forward=Stateful(model),
                             prefix_caching=True)


def test_a_disaggregated_prefill_hands_off_cached_pages(llama_dir):
    prefiller = _spec(llama_dir).build_engines({LLM_PREFILL}, torch.device("cpu"))[LLM_PREFILL]
    first = prefiller.run([_prefill("a", SYSTEM + [1])])[0].outputs
    assert prefiller.engine.pool.num_used_pages == 0 and prefiller.engine.pool.num_cached_pages == 2
    second = prefiller.run([_prefill("b", SYSTEM + [1])])[0].outputs
    assert prefiller.engine.prefix_hits == 8
    assert int(first["token"]) == int(second["token"])
    torch.testing.assert_close(second["kv"], first["kv"], rtol=0, atol=1e-6)
    assert torch.equal(second["kv"][:, :, :8], first["kv"][:, :, :8])  # the very pages
