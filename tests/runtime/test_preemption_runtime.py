"""Preemption through the in-process runtime: a KV pool that holds about two of the requests
at full length serves six at once. Requests are admitted against their prompts' pages, the
engine preempts the newest sequences when the pool runs out, the conductor sends their
steps again, and every request streams exactly what it streams alone. A prefill budget of
a few tokens per step defers prompts too (given back and sent again the same way). A tiny
random Llama on the CPU, through the backend as the server drives it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.runtime.launch import Deployment, start
from tests.e2e.inprocess import poll_drained

PAGES, PAGE_SIZE = 20, 4  # 80 positions; a request grows to 10 to 12 pages
MAX_TOKENS = 32
TEXTS = ["the cat sat", "on a mat, twice", "hello", "paged attention!", "seven words", "zzz yyy"]


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "overlap"])
def deployment(request, tmp_path_factory):
    model_dir = tiny_llama_dir(tmp_path_factory.mktemp("preempt-rt"), num_hidden_layers=2)
    d = start(parse_config({
        "model": "llama", "model_path": str(model_dir), "load_format": "dummy", "device": "cpu",
        "dtype": "float32", "max_seq_len": 128, "max_concurrent_requests": 8,
        "resources": {"kv_cache": {"max_num_pages": PAGES, "page_size": PAGE_SIZE}},
        "model_kwargs": {"overlap_scheduling": request.param, "max_prefill_tokens": 8},
    }), in_process=True)
    try:
        yield d
    finally:
        d.close()


def _engine(d: Deployment):
    return d.runtime.workers.workers[0].engines["llm"]


async def _generate(d: Deployment, text: str, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str | None]:
    spec = GenerateSpec(f"p-{uuid.uuid4().hex[:12]}", text, [], ["text"],
                        {"chat": False, "max_tokens": max_tokens, "temperature": 0.0})
    ids: list[int] = []
    reason = None
    async for event in d.backend.generate(spec):
        assert event.error is None, event.error
        ids += event.token_ids
        reason = event.finish_reason or reason
    return ids, reason


def _drained(d: Deployment) -> None:
    engine = _engine(d)
    poll_drained(d, engine)
    assert engine.pool.num_used_pages == 0, f"KV pages still held by {engine.pool.seq_ids()}"
    assert engine.seqs == {} and engine._ahead is None
    assert all(units == 0 for units in d.runtime.conductor.in_use.values())
    engine.pool.check_invariants()


def test_concurrent_requests_in_a_pool_too_small_for_all_equal_their_solo_outputs(deployment) -> None:
    d = deployment
    alone = [asyncio.run(_generate(d, text)) for text in TEXTS]
    _drained(d)
    before = _engine(d).preemptions
    assert sum(len(ids) for ids, _ in alone) > 4 * MAX_TOKENS  # long enough to fill the pool

    async def together():
        return await asyncio.wait_for(asyncio.gather(*(_generate(d, text) for text in TEXTS)), timeout=120)

    assert asyncio.run(together()) == alone
    assert _engine(d).preemptions > before
    assert _engine(d).deferred > 0 and d.runtime.rank_gauges[0]["llm.prefills_deferred"] == _engine(d).deferred
    assert d.runtime.rank_gauges[0]["llm.preemptions"] == _engine(d).preemptions
    _drained(d)


def test_a_request_the_whole_pool_cannot_hold_is_refused_naming_max_tokens(deployment) -> None:
    with pytest.raises(RequestError) as err:
        asyncio.run(_generate(deployment, "hello", max_tokens=PAGES * PAGE_SIZE))
    assert err.value.field == "max_tokens" and "kv_pages" in err.value.message
    _drained(deployment)
