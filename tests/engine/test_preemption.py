"""Preemption in the autoregressive engine: pages are reserved as sequences grow, and when
the pool runs out the newest sequences give theirs back and are recomputed later. Driven
like the conductor drives it (a step given back is sent again; a finished request is
released), every request must come out exactly as it does alone, none lost or duplicated,
and the pool must end empty and consistent."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.forward import Forward
from mstar.engine.page_pool import OutOfPages
from mstar.model.registry import model_class
from tests.support.markers import needs_cuda
from tests.support.models import GPU_LLAMA, random_llama

PAGE_SIZE = 4
MAX_NEW = 24
GREEDY = {"temperature": 0.0}
PROMPTS: dict[str, list[int]] = {  # 5..12 tokens: each request needs 8..9 pages at full length
    "a": [3, 1, 4, 1, 5, 9, 2, 6],
    "b": [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5],
    "c": [1, 4, 1, 4, 2],
    "d": [6, 6, 2, 6, 0, 7, 0, 1, 5],
    "e": [5, 7, 7, 2, 1, 5, 6, 6, 4, 9],
    "f": [9, 9, 9, 8, 8, 8, 7],
}
SAMPLING = {rid: GREEDY for rid in PROMPTS} | {"e": {"temperature": 1.0, "seed": 7}}  # one seeded row
LATE = {"e", "f"}  # arrive after the others have started to decode


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = parse_config({
        "model": "llama", "model_path": str(tiny_llama_dir(tmp_path_factory.mktemp("preempt"))),
        "load_format": "dummy", "device": "cpu", "dtype": "float32", "max_seq_len": 64,
        "max_concurrent_requests": 8, "resources": {"kv_cache": {"max_num_pages": 64, "page_size": PAGE_SIZE}},
    }, "test")
    return model_class("llama")(config).build_engines({"llm"}, torch.device("cpu"))["llm"].model


def _engine(model, pages: int, forward: Forward | None = None, **kwargs) -> AutoregressiveEngine:
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=pages, page_size=PAGE_SIZE,
                                max_seq_len=64, device=torch.device("cpu"), dtype=torch.float32, forward=forward,
                                **kwargs)


def _prefill(rid: str, max_new: int = MAX_NEW, prompts: dict[str, list[int]] = PROMPTS) -> EngineItem:
    params = {"sampling": SAMPLING[rid], "max_new_tokens": max_new, "stop_token_ids": []}
    return EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompts[rid])}, params)


def serve(engine: AutoregressiveEngine, rids: list[str], late: set[str] = frozenset(),
          max_new: int = MAX_NEW, prompts: dict[str, list[int]] = PROMPTS) -> tuple[dict[str, list[int]], int]:
    """Run the requests to their end as the conductor would; their tokens, and how many of
    the items sent were given back."""
    waiting = [rid for rid in rids if rid in late]
    pending = {rid: _prefill(rid, max_new, prompts) for rid in rids if rid not in late}  # admission order
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    given_back = 0
    for step in range(2000):
        if step == 5:
            pending |= {rid: _prefill(rid, max_new, prompts) for rid in waiting}
        if not pending:
            break
        items = list(pending.values())
        for item, out in zip(items, engine.run(items)):
            engine.pool.check_invariants()
            if out.preempted:  # sent again as it was
                assert not out.outputs and not out.flags
                given_back += 1
                continue
            tokens[item.request_id].append(int(out.outputs["token"]))
            if "stop" in out.flags:
                del pending[item.request_id]
                engine.release(item.request_id)
            else:
                pending[item.request_id] = EngineItem(item.request_id, "decode", item.iteration + 1,
                                                      {"token": out.outputs["token"]}, {})
    assert not pending, "the requests did not finish"
    return tokens, given_back


@pytest.fixture(scope="module")
def solo(model) -> dict[str, list[int]]:
    """Each request alone in a pool that holds it whole."""
    out = {}
    for rid in PROMPTS:
        tokens, given_back = serve(_engine(model, 64), [rid])
        assert given_back == 0
        out |= tokens
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["eager", "overlap"])
def test_a_pool_too_small_for_all_requests_preempts_and_every_request_ends_as_alone(model, solo, overlap) -> None:
    engine = _engine(model, 18, overlap_scheduling=overlap)  # about two requests at full length
    tokens, given_back = serve(engine, list(PROMPTS), LATE)
    assert tokens == solo
    assert all(len(t) == MAX_NEW for t in tokens.values())  # each token exactly once
    assert engine.preemptions > 0 and given_back > 0
    assert engine.stats()["preemptions"] == engine.preemptions
    assert not engine.seqs and engine._ahead is None
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


def test_the_oldest_sequence_takes_the_newest_ones_pages_and_new_prefills_wait_their_turn(model) -> None:
    engine = _engine(model, 10)
    outs = engine.run([_prefill("a"), _prefill("b")])  # 2 + 3 pages
    assert not any(o.preempted for o in outs)
    engine.pool.reserve("older", 3 * PAGE_SIZE)  # pages of a holder no step may take (2 stay free)
    last = {rid: o.outputs["token"] for rid, o in zip("ab", outs)}
    outs = engine.run([EngineItem(rid, "decode", 0, {"token": last[rid]}, {}) for rid in "ab"] + [_prefill("c")])
    # a and b grow by a page each; c's prompt then finds none free: it waits, and is taken in afresh later
    assert [o.preempted for o in outs] == [False, False, True]
    assert "c" not in engine.seqs and engine.pool.num_free_pages == 0 and engine.preemptions == 0
    last = {rid: o.outputs["token"] for rid, o in zip("ab", outs)}
    while True:  # until a needs a page: it takes b's, the newest holding any
        outs = engine.run([EngineItem(rid, "decode", 0, {"token": last[rid]}, {}) for rid in "ab"])
        if outs[1].preempted:
            break
        assert not outs[0].preempted
        last = {rid: o.outputs["token"] for rid, o in zip("ab", outs)}
    assert not outs[0].preempted and engine.preemptions == 1
    assert not engine.pool.has("b") and engine.seqs["b"].computed == 0
    last["a"] = outs[0].outputs["token"]
    outs = engine.run([EngineItem(rid, "decode", 0, {"token": last[rid]}, {}) for rid in "ab"])
    assert [o.preempted for o in outs] == [False, True]  # b waits for free pages: it takes none from a
    engine.pool.free("older")
    outs = engine.run([EngineItem("a", "decode", 0, {"token": outs[0].outputs["token"]}, {}),
                       EngineItem("b", "decode", 0, {"token": last["b"]}, {})])
    assert not any(o.preempted for o in outs)  # b recomputed its history and went on
    assert engine.seqs["b"].computed == len(engine.seqs["b"].tokens) - 1
    for rid in "ab":
        engine.release(rid)
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


def test_a_sequence_the_whole_pool_cannot_hold_fails_instead_of_waiting(model) -> None:
    engine = _engine(model, 4)  # 16 positions
    items = [_prefill("c", max_new=30)]  # 5 tokens of prompt: it outgrows the pool at 17
    with pytest.raises(ValueError, match="whole pool holds 4"):
        for _ in range(30):
            out = engine.run(items)[0]
            assert not out.preempted
            items = [EngineItem("c", "decode", 0, {"token": out.outputs["token"]}, {})]
    assert engine.seqs["c"].computed == 16  # it ran while it fitted: its 17th token has no room
    engine.release("c")
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


class _Stateful(Forward):
    preemptible = False  # like Qwen3.5's recurrent state


def test_a_forward_that_cannot_recompute_never_preempts(model) -> None:
    engine = _engine(model, 5, forward=_Stateful(model))
    engine.run([_prefill("a")])  # 2 pages
    engine.run([_prefill("b")])  # 3 pages: the pool is full
    with pytest.raises(OutOfPages):
        engine.run([_prefill("c")])
    assert engine.preemptions == 0 and engine.pool.has("a") and engine.pool.has("b")
    for rid in "abc":
        engine.release(rid)
    assert engine.pool.num_used_pages == 0


def test_a_prefill_budget_runs_the_oldest_prompts_that_fit_and_gives_the_rest_back(model) -> None:
    engine = _engine(model, 64, max_prefill_tokens=20)
    outs = engine.run([_prefill(rid) for rid in "abcd"])  # 8 + 12 fit; c (5 more) waits, so does d
    assert [o.preempted for o in outs] == [False, False, True, True]
    assert set(engine.seqs) == {"a", "b"} and not engine.pool.has("c")
    decodes = [EngineItem(rid, "decode", 0, {"token": o.outputs["token"]}, {}) for rid, o in zip("ab", outs)]
    outs = engine.run(decodes + [_prefill("c"), _prefill("d"), _prefill("e")])
    # the decodes do not count: c and d (14) run, e (10 more) waits
    assert [o.preempted for o in outs] == [False, False, False, False, True]
    big = {"big": list(range(30))}
    outs = engine.run([EngineItem("big", "prefill", 0, {"prompt_ids": torch.tensor(big["big"])},
                                  {"sampling": GREEDY, "max_new_tokens": 4, "stop_token_ids": []}),
                       _prefill("e")])
    assert [o.preempted for o in outs] == [False, True]  # the oldest runs whatever its length
    assert engine.deferred == 2 + 1 + 1 and engine.stats()["prefills_deferred"] == 4
    for rid in list(engine.seqs):
        engine.release(rid)
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["eager", "overlap"])
def test_under_a_prefill_budget_every_request_ends_as_alone(model, solo, overlap) -> None:
    engine = _engine(model, 64, overlap_scheduling=overlap, max_prefill_tokens=13)
    tokens, given_back = serve(engine, list(PROMPTS), LATE)
    assert tokens == solo
    assert given_back >= 4 and engine.deferred == given_back and engine.preemptions == 0
    assert not engine.seqs
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


def test_a_prefill_budget_counts_only_what_the_prefix_cache_does_not_hold(model) -> None:
    prompts = {rid: SHARED + PROMPTS[rid][:3] for rid in "abc"}  # 11 tokens, 8 of them cached after a
    engine = _engine(model, 64, prefix_caching=True, max_prefill_tokens=12)
    first = engine.run([_prefill("a", prompts=prompts)])
    assert not first[0].preempted
    outs = engine.run([_prefill("b", prompts=prompts), _prefill("c", prompts=prompts)])
    assert [o.preempted for o in outs] == [False, False]  # 3 + 3 new tokens, not 11 + 11
    for rid in "abc":
        engine.release(rid)
    assert engine.pool.num_used_pages == 0


def test_a_prefill_budget_needs_a_forward_that_can_give_a_step_back(model) -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        _engine(model, 8, forward=_Stateful(model), max_prefill_tokens=16)


SHARED = [7, 3, 5, 3, 0, 8, 2, 4]  # two whole pages every prompt of the next test starts with


@pytest.mark.parametrize("overlap", [False, True], ids=["eager", "overlap"])
def test_preemption_with_the_prefix_cache_on_ends_every_request_as_alone_without_it(model, overlap) -> None:
    """Prefix caching and preemption together: cached pages are shared while sequences are
    preempted and resumed; every request still ends with its solo, cache-off output."""
    prompts = {rid: SHARED + PROMPTS[rid][:4] for rid in PROMPTS}
    alone = {}
    for rid in prompts:
        alone |= serve(_engine(model, 64), [rid], prompts=prompts)[0]
    engine = _engine(model, 18, overlap_scheduling=overlap, prefix_caching=True)
    tokens, given_back = serve(engine, list(prompts), LATE, prompts=prompts)
    assert tokens == alone
    assert engine.preemptions > 0 and given_back > 0
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert not engine.seqs
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0


@needs_cuda(triton=True)
def test_fast_paths_with_the_prefix_cache_and_preemption_match_eager_on_gpu() -> None:
    """On the GPU: Triton attention, graph-replayed decodes, overlap, prefix caching and a pool
    that forces preemption, against each request alone in the eager PyTorch reference, token
    for token (float32)."""
    device = torch.device("cuda")
    model = random_llama(device, **GPU_LLAMA)
    common = dict(page_size=16, max_seq_len=128, device=device, dtype=torch.float32)
    shared = list(range(100, 132))  # two whole pages
    prompts = {rid: shared + PROMPTS[rid][:4] for rid in PROMPTS}
    alone = {}
    for rid in prompts:
        alone |= serve(AutoregressiveEngine(model, KVLayout(2, 2, 64), num_pages=64, **common), [rid],
                       prompts=prompts)[0]
    fast = AutoregressiveEngine(model, KVLayout(2, 2, 64), num_pages=10, cuda_graphs=True,
                                graph_batch_sizes=(1, 2, 4, 8), attention_backend="triton",
                                overlap_scheduling=True, prefix_caching=True, **common)
    tokens, _ = serve(fast, list(prompts), LATE, prompts=prompts)
    assert tokens == alone
    assert fast.preemptions > 0 and fast.stats()["prefix_cache_hit_tokens"] > 0
    assert fast.graphs.captured_batch_sizes
    assert fast.pool.num_used_pages == 0
