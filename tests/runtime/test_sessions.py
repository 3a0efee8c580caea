"""The session bookkeeping (``mstar.runtime.sessions``) with an injected clock: 409 for a
busy session, 410 for a gone one, LRU eviction of idle sessions only, expiry, end, pins, a
restarted rank; the worker's store and the handle engines see; and the conductor sending a
session's drop on every live rank ahead of the items of the same plan."""

from __future__ import annotations

import pytest

from mstar.contract import RequestError, SessionSpec
from mstar.runtime.conductor import Conductor, RequestSpec
from mstar.runtime.protocol import SessionRef
from mstar.runtime.sessions import SessionBook, SessionHandle, SessionStore
from tests.runtime.conductor_rig import GRAPH, single_rank, two_ranks

R0 = frozenset({0})


def started(book: SessionBook, name: str, now: float, **fields) -> list[str]:
    return book.begin(SessionSpec(name, **fields), R0, now)


def test_a_busy_session_refuses_a_second_request_with_409():
    book = SessionBook(store_size=4, timeout_max_s=100)
    assert started(book, "a", 0) == []
    for resume in (True, False):
        with pytest.raises(RequestError) as err:
            started(book, "a", 1, resume=resume)
        assert err.value.status == 409 and err.value.field == "session_id" and "'a'" in err.value.message
    assert book.finish("a", keep=True, now=2) == []
    assert started(book, "a", 3, resume=True) == []
    assert book.busy == 1 and book.open == 1


def test_resuming_an_unknown_or_ended_session_gets_410():
    book = SessionBook(store_size=4, timeout_max_s=100)
    with pytest.raises(RequestError) as err:
        started(book, "nope", 0, resume=True)
    assert err.value.status == 410 and "'nope'" in err.value.message
    started(book, "a", 0)
    assert book.finish("a", keep=False, now=1) == ["a"]  # ended, failed or cancelled: dropped
    with pytest.raises(RequestError) as err:
        started(book, "a", 2, resume=True)
    assert err.value.status == 410


def test_idle_sessions_past_the_store_size_are_evicted_least_recently_used_first():
    book = SessionBook(store_size=2, timeout_max_s=100)
    for t, name in enumerate("abc"):
        started(book, name, t)
    started(book, "busy", 3)  # in flight: never evicted, not counted as idle
    assert book.finish("b", keep=True, now=4) == []
    assert book.finish("a", keep=True, now=5) == []
    assert book.finish("c", keep=True, now=6) == ["b"]  # b finished first: least recently used
    assert "busy" in book and "b" not in book
    started(book, "a", 7, resume=True)  # a is used again: c is now the least recent
    started(book, "d", 8)
    assert book.finish("d", keep=True, now=9) == []
    assert book.finish("a", keep=True, now=10) == ["c"]
    assert book.finish("busy", keep=True, now=11) == ["d"]


def test_idle_sessions_expire_and_timeouts_are_capped():
    book = SessionBook(store_size=8, timeout_max_s=50)
    started(book, "short", 0, timeout_s=5)
    started(book, "long", 0, timeout_s=10_000)  # capped at 50
    book.finish("short", keep=True, now=10)
    book.finish("long", keep=True, now=10)
    assert book.expire(14.9) == []
    assert book.expire(15) == ["short"]
    assert book.expire(59.9) == []
    assert book.expire(60) == ["long"]
    with pytest.raises(RequestError) as err:
        started(book, "short", 61, resume=True)
    assert err.value.status == 410
    with pytest.raises(RequestError) as err:
        started(book, "bad", 61, timeout_s=0)
    assert err.value.field == "session_timeout_s"


def test_a_busy_session_does_not_expire_and_begin_expires_what_is_due():
    book = SessionBook(store_size=8, timeout_max_s=50)
    started(book, "a", 0, timeout_s=1)
    assert book.expire(100) == []  # busy
    book.finish("a", keep=True, now=100)
    started(book, "b", 0)
    assert book.begin(SessionSpec("c"), R0, 200) == ["a"]  # due: dropped with this submission


def test_end_drops_an_idle_session_now_and_a_busy_one_when_its_request_ends():
    book = SessionBook(store_size=8, timeout_max_s=50)
    started(book, "idle", 0)
    book.finish("idle", keep=True, now=1)
    assert book.end("idle") == ["idle"] and "idle" not in book
    started(book, "busy", 2)
    assert book.end("busy") == []
    assert book.finish("busy", keep=True, now=3) == ["busy"]
    assert book.end("never") == []


def test_a_fresh_start_under_a_kept_name_drops_its_old_state():
    book = SessionBook(store_size=8, timeout_max_s=50)
    started(book, "a", 0)
    book.finish("a", keep=True, now=1)
    assert started(book, "a", 2) == ["a"]


def test_pinned_sessions_are_neither_evicted_nor_expired():
    book = SessionBook(store_size=1, timeout_max_s=50)
    book.pin("live")
    started(book, "live", 0, timeout_s=1)
    book.finish("live", keep=True, now=1)
    started(book, "other", 2)
    assert book.finish("other", keep=True, now=3) == ["other"]  # the pinned one stays; the other goes
    assert book.expire(1000) == []
    book.pin("live")  # a second socket names it too
    book.pin("live", False)
    assert book.expire(1000) == []
    book.pin("live", False)
    assert book.expire(1000) == ["live"]


def test_a_restarted_rank_loses_the_sessions_that_ran_there():
    book = SessionBook(store_size=8, timeout_max_s=50)
    book.begin(SessionSpec("on0"), frozenset({0}), 0)
    book.begin(SessionSpec("on1"), frozenset({1}), 0)
    book.begin(SessionSpec("both"), frozenset({0, 1}), 0)
    for name in ("on0", "on1"):
        book.finish(name, keep=True, now=1)
    assert book.lost_rank(0) == ["on0"]  # idle: gone now (its other ranks drop it too)
    assert book.finish("both", keep=True, now=2) == ["both"]  # busy: gone when its request ends
    with pytest.raises(RequestError) as err:
        book.begin(SessionSpec("on0", resume=True), frozenset({0}), 3)
    assert err.value.status == 410
    assert book.begin(SessionSpec("on1", resume=True), frozenset({1}), 3) == []


def test_store_and_handle():
    store = SessionStore()
    a = SessionHandle(store, "s", "dit", resume=False)
    b = SessionHandle(store, "s", "vae", resume=True)
    assert a.get() is None
    a.put(1)
    b.put(2)
    assert (a.get(), b.get(), len(store), store.sessions) == (1, 2, 1, ["s"])
    assert store.held() == {"dit": 1, "vae": 1}
    a.drop()
    assert a.get() is None and b.get() == 2 and store.held() == {"dit": 0, "vae": 1}
    store.drop("s")
    assert len(store) == 0 and b.get() is None and store.held() == {"dit": 0, "vae": 0}


def test_the_conductor_drops_sessions_on_every_live_rank_before_the_plans_items():
    conductor = Conductor(GRAPH, two_ranks(), max_concurrent_requests=4)
    conductor.drop_sessions(["old"])
    assert not conductor.idle and conductor.has_work_for_idle_rank()
    conductor.submit(RequestSpec("r1", "fork", {}, session=SessionRef("s", True)))
    plans = conductor.tick(0.0).plans
    assert set(plans) == {0, 1}
    assert all(plan.drop_sessions == ["old"] for plan in plans.values())
    items = [item for plan in plans.values() for item in plan.items]
    assert items and all(item.session == SessionRef("s", True) for item in items)
    assert all(plan.drop_sessions == [] for plan in conductor.tick(0.1).plans.values())


def test_a_failed_rank_is_sent_no_drops():
    conductor = Conductor(GRAPH, single_rank(GRAPH), max_concurrent_requests=4)
    conductor.on_rank_failed(0, "gone")
    conductor.drop_sessions(["s"])
    assert conductor.idle and conductor.tick(0.0).plans == {}


def test_the_session_keys_are_typed_in_the_deployment_config():
    from mstar.config import ConfigError, parse_config

    config = parse_config({"model": "m", "session_store_size": 3, "session_timeout_max_s": 30})
    assert (config.session_store_size, config.session_timeout_max_s) == (3, 30)
    assert (parse_config({"model": "m"}).session_store_size, parse_config({"model": "m"}).session_timeout_max_s) \
        == (16, 3600)
    with pytest.raises(ConfigError, match="session_store_size"):
        parse_config({"model": "m", "session_store_size": 0})
    with pytest.raises(ConfigError, match="session_store: unknown key"):
        parse_config({"model": "m", "session_store": 4})


def test_a_worker_restart_drops_its_sessions_and_a_resume_then_gets_410():
    """The runtime's loop against hand-answered workers: a session's request runs on rank 0,
    rank 0 dies and is restarted, and the session is gone (410 on resume, dropped on rank 0)."""
    import time

    import torch

    from mstar.model.spec import WalkRequest
    from mstar.runtime.protocol import WorkerFailed
    from mstar.runtime.runtime import Runtime
    from tests.runtime.test_runtime_loop import TIMEOUT, HeldWorkers, Nowhere, Stream

    class Restartable(HeldWorkers):
        def restart(self, rank, ready) -> None:  # the new process loads at once
            ready(rank, {})

    placement = single_rank(GRAPH)
    workers = Restartable()
    runtime = Runtime(Conductor(GRAPH, placement, max_concurrent_requests=4), placement, workers, Nowhere(),
                      sessions=SessionBook(4, 60))
    runtime.supervise(3)
    paint = WalkRequest("paint", {"x": torch.zeros(1)}, {"n": 1})
    try:
        runtime.submit("r1", paint, Stream(), lambda event: None, session=SessionSpec("s"))
        plan = workers.next_plan()
        assert plan.items[0].session == SessionRef("s", False)
        workers.finish(plan)
        deadline = time.monotonic() + TIMEOUT
        while runtime.tracked or runtime.sessions.busy:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert "s" in runtime.sessions
        workers.pool._results.put(WorkerFailed(0, "killed"))
        while "s" in runtime.sessions or not runtime.healthy:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        drops = []
        while not drops:
            drops = workers.plans.get(timeout=TIMEOUT).drop_sessions
        assert drops == ["s"]
        with pytest.raises(RequestError) as err:
            runtime.submit("r2", paint, Stream(), lambda event: None, session=SessionSpec("s", resume=True))
        assert err.value.status == 410 and not runtime.tracked
    finally:
        runtime.close()


def test_the_session_fields_cross_the_wire():
    from mstar.runtime.protocol import StepPlan, VarRef, WorkItem, decode, encode

    item = WorkItem("r", "dit", "forward", "step", 0, {"x": VarRef("x", 0)}, {}, session=SessionRef("s", True))
    plan = StepPlan(7, [item], ["old-request"], ["old-session"])
    assert decode(encode(plan)) == plan
    assert decode(encode(StepPlan(8))).drop_sessions == []
