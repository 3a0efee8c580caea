"""The session bookkeeping (``mstar.runtime.sessions``) with an injected clock: 409 for a
busy session, 410 for a gone one, LRU eviction of idle sessions only, expiry, end, pins, a
restarted rank; ``session_store_bytes``: per-rank byte budgets over idle sessions (a property
test replays random runs), a session over it by itself not kept; the worker's store and the
handle engines see; the conductor sending a session's drop on every live rank ahead of the
items of the same plan; and a split group's followers: their own session state, and their own
bytes and gauges counted per rank by the runtime."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ------------------------------------------------------------- session_store_bytes
def ran(book: SessionBook, name: str, now: float, held: dict[int, int], **fields) -> list[str]:
    """A request of session ``name`` on the ranks of ``held``, which report those bytes; it finishes
    at ``now``: the sessions the book drops then."""
    book.begin(SessionSpec(name, **fields), frozenset(held), now)
    for rank, nbytes in held.items():
        book.note_bytes(name, rank, nbytes)
    return book.finish(name, keep=True, now=now)


def test_without_a_byte_budget_bytes_evict_nothing():
    book = SessionBook(store_size=8, timeout_max_s=100)
    assert [ran(book, name, t, {0: 10 ** 12}) for t, name in enumerate("abc")] == [[], [], []]
    assert book.open == 3


def test_idle_bytes_past_the_budget_evict_the_least_recently_used_on_that_rank():
    book = SessionBook(store_size=8, timeout_max_s=100, store_bytes=100)
    assert ran(book, "a", 0, {0: 40}) == []
    assert ran(book, "other", 1, {1: 90}) == []  # rank 1's bytes: rank 0's budget is its own
    assert ran(book, "b", 2, {0: 40}) == []
    book.begin(SessionSpec("busy"), R0, 3)
    book.note_bytes("busy", 0, 500)  # in flight: neither counted nor evicted
    assert ran(book, "c", 4, {0: 40}) == ["a"]  # 120 on rank 0: a is the least recently used there
    assert "other" in book and "busy" in book
    assert ran(book, "b", 5, {0: 50}, resume=True) == []  # 90: b grew by 10 and is now the most recent
    assert ran(book, "d", 6, {0: 20}) == ["c"]  # 110: c (40) goes before b
    assert book.finish("busy", keep=True, now=7) == ["busy"]  # 500 alone: over by itself


def test_a_session_over_the_budget_by_itself_is_not_kept_and_evicts_nothing_else():
    book = SessionBook(store_size=8, timeout_max_s=100, store_bytes=100)
    ran(book, "a", 0, {0: 60})
    ran(book, "b", 1, {1: 60})
    assert ran(book, "huge", 2, {0: 10, 1: 101}) == ["huge"]
    assert "a" in book and "b" in book and "huge" not in book
    with pytest.raises(RequestError) as err:
        started(book, "huge", 3, resume=True)
    assert err.value.status == 410 and "'huge'" in err.value.message


def test_a_resume_keeps_the_bytes_its_state_holds_on_ranks_it_did_not_run_on():
    book = SessionBook(store_size=8, timeout_max_s=100, store_bytes=100)
    ran(book, "a", 0, {0: 70, 1: 30})
    ran(book, "a", 1, {1: 40}, resume=True)  # its rank-0 state is still there: 70
    assert ran(book, "b", 2, {0: 50}) == ["a"]


def test_pinned_sessions_count_but_are_never_evicted_for_bytes():
    book = SessionBook(store_size=8, timeout_max_s=100, store_bytes=100)
    book.pin("live")
    assert ran(book, "live", 0, {0: 150}) == []  # pinned: kept even over the budget by itself
    assert ran(book, "a", 1, {0: 1}) == ["a"]  # rank 0 is over with the pinned one alone
    assert ran(book, "b", 2, {1: 1}) == []
    book.pin("live", False)
    assert ran(book, "c", 3, {0: 1}) == ["live"]


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(1, 100), data=st.data())
def test_byte_eviction_keeps_every_rank_under_the_budget_least_recently_used_first(budget, data):
    """Random sessions run (fresh or resumed), report bytes on random ranks and finish. After each
    finish: no busy or pinned session was dropped; the finishing one is dropped alone when it is
    over the budget by itself; every other drop, replayed in order, was the least recently used
    unpinned idle session holding bytes on a rank then over the budget; and afterwards no rank is
    over unless only pinned sessions hold bytes there."""
    names = [f"s{i}" for i in range(6)]
    pinned = set(data.draw(st.sets(st.sampled_from(names), max_size=2)))
    book = SessionBook(store_size=100, timeout_max_s=1e9, store_bytes=budget)
    for name in pinned:
        book.pin(name)
    idle: dict[str, dict[int, int]] = {}  # least recently used first
    busy: dict[str, dict[int, int]] = {}
    for now in range(40):
        name = data.draw(st.sampled_from(names))
        if name not in busy:
            resume = name in idle and data.draw(st.booleans())
            ranks = data.draw(st.sets(st.integers(0, 2), min_size=1, max_size=2))
            drops = book.begin(SessionSpec(name, resume=resume), frozenset(ranks), now)
            held = idle.pop(name, {}) if resume else {}
            assert drops == ([name] if name in idle else [])
            idle.pop(name, None)
            for rank in ranks:
                held[rank] = data.draw(st.integers(0, 60))
                book.note_bytes(name, rank, held[rank])
            busy[name] = held
            continue
        held = busy.pop(name)
        drops = book.finish(name, keep=True, now=now)
        if name not in pinned and max(held.values(), default=0) > budget:
            assert drops == [name]
            continue
        idle[name] = held
        assert not set(drops) & (set(busy) | pinned)

        def totals() -> dict[int, int]:
            out: dict[int, int] = {}
            for kept in idle.values():
                for rank, nbytes in kept.items():
                    out[rank] = out.get(rank, 0) + nbytes
            return out

        for dropped in drops:
            over = {rank for rank, total in totals().items() if total > budget}
            candidates = [s for s, kept in idle.items() if s not in pinned and any(kept.get(r) for r in over)]
            assert candidates and candidates[0] == dropped
            del idle[dropped]
        for rank, total in totals().items():
            assert total <= budget or all(s in pinned for s, kept in idle.items() if kept.get(rank))
        assert all(s in book for s in [*idle, *busy])


def test_session_store_bytes_is_a_typed_config_key():
    from mstar.config import ConfigError, parse_config

    assert parse_config({"model": "m"}).session_store_bytes is None
    assert parse_config({"model": "m", "session_store_bytes": 4096}).session_store_bytes == 4096
    assert parse_config({"model": "m", "session_store_bytes": "2GiB"}).session_store_bytes == 2 << 30
    for bad in (0, "lots"):
        with pytest.raises(ConfigError, match="session_store_bytes"):
            parse_config({"model": "m", "session_store_bytes": bad})


def test_a_step_result_carries_the_bytes_of_the_sessions_that_ran():
    from mstar.runtime.protocol import StepResult, decode, encode

    result = StepResult(0, 3, session_bytes={"s": 1 << 40}, follower_session_bytes={1: {"s": 1 << 39}},
                        follower_gauges={1: {"dit.session_bytes": 2.0 ** 39}})
    assert decode(encode(result)) == result and decode(encode(StepResult(0, 4))).session_bytes == {}
    assert decode(encode(StepResult(0, 4))).follower_session_bytes == {}


def test_a_size_noted_for_an_idle_session_applies_the_budget_at_once():
    """The runtime notes sizes while a session is busy; should one come for an idle session
    (a follower's, say, after its request ended), the budget holds all the same."""
    book = SessionBook(store_size=8, timeout_max_s=100, store_bytes=100)
    assert ran(book, "a", 0, {0: 40, 1: 40}) == []
    assert ran(book, "b", 1, {0: 40, 1: 40}) == []
    assert book.note_bytes("b", 1, 40) == []  # no change
    assert book.note_bytes("a", 1, 70) == ["a"]  # rank 1: 110, a is the least recently used
    assert book.note_bytes("b", 1, 101) == ["b"]  # over by itself
    assert book.open == 0
    book.pin("p")
    ran(book, "p", 2, {0: 10})
    assert book.note_bytes("p", 0, 500) == [] and "p" in book  # pinned: kept
    assert book.note_bytes("gone", 0, 500) == []  # unknown: nothing


def test_a_split_groups_follower_keeps_and_drops_its_own_session_state():
    """The leader's calls carry their items' sessions: the follower's engine gets a handle on
    the follower's own store, so both keep the same state (a resume reads it on both); the
    sessions a plan drops are dropped on the follower too."""
    import msgspec
    import torch

    from mstar.engine.base import EngineItem
    from mstar.runtime.lockstep import (
        Follower,
        LeaderEngine,
        Message,
        drop_followers_sessions,
        stop_followers,
    )
    from tests.support.rollout import DIM, RolloutEngine

    class Wire:
        """The leader's end sends, the follower's end receives, in order (msgpack on the way).
        One process plays both ends one after the other, so the follower's answers are kept
        (``answers``) and the leader's gather finds none (tests/distributed/
        test_lockstep_sessions.py has the two ends answer each other)."""

        def __init__(self) -> None:
            self.queue: list = []
            self.reports: dict = {}
            self.answers: list[list[int]] = []

        def answer(self, values) -> None:
            self.answers.append(list(values))

        def gather(self, count: int) -> dict:
            return {}

        def send(self, message, tensors=()) -> None:
            data = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
            self.queue.append((msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=Message),
                               torch.cat(data) if data else torch.empty(0, dtype=torch.uint8)))

        def recv(self):
            return self.queue.pop(0)

    wire, store = Wire(), SessionStore()
    leader = {"roll": LeaderEngine("roll", RolloutEngine(), wire)}
    follower = Follower(1, wire, {"roll": RolloutEngine()})
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(1))

    def step(request_id: str, session_id: str, resume: bool, i: int) -> None:
        handle = SessionHandle(store, session_id, "roll", resume)
        leader["roll"].run([EngineItem(request_id, "step", i, {"controls": x}, {}, session=handle)])

    def follow() -> None:
        stop_followers(leader)
        follower.run()

    step("r1", "s", False, 0)
    step("r1", "s", False, 1)
    step("t1", "t", False, 0)
    leader["roll"].release("r1")
    step("r2", "s", True, 2)  # a resume: both go on from their kept trail
    follow()
    for session_id, steps in (("s", 3), ("t", 1)):
        ours, theirs = store.get(session_id, "roll"), follower.sessions.get(session_id, "roll")
        assert theirs is not None and len(theirs.frames) == steps and torch.equal(theirs.frames, ours.frames)
    # it answered each call with a session: the bytes of its sessions, then the node's gauges
    frame = DIM * 4
    assert wire.answers == [[frame, 1, frame], [2 * frame, 1, 2 * frame], [frame, 2, 3 * frame],
                            [3 * frame, 2, 4 * frame]]
    drop_followers_sessions(leader, ["s"])
    follow()
    assert follower.sessions.sessions == ["t"]
    assert wire.answers[-1] == [1, frame]  # the drop's: the node's gauges after it


def test_a_split_groups_followers_count_with_their_own_bytes_and_go_with_its_restart():
    """The runtime's loop against hand-answered workers, every node in a group split over
    ranks 0 (leader) and 1: the leader's StepResult carries the follower's own bytes and
    gauges, which the book weighs and ``gauges`` shows for rank 1; a session whose follower
    shard alone is over the budget is not kept though the leader's is under it; a restart of
    the group forgets the sessions and the follower's gauges."""
    import time

    import torch

    from mstar.model.spec import WalkRequest
    from mstar.runtime.placement import NodeGroup, Placement
    from mstar.runtime.protocol import ItemResult, StepResult, WorkerFailed
    from mstar.runtime.runtime import Runtime
    from tests.runtime.test_runtime_loop import TIMEOUT, HeldWorkers, Nowhere, Stream

    class Restartable(HeldWorkers):
        def restart(self, rank, ready) -> None:
            ready(rank, {})

    nodes = ("encoder", "llm", "left", "right", "join", "painter")
    placement = Placement(GRAPH, (NodeGroup(nodes, (0, 1), tp_size=2),))
    workers = Restartable()
    runtime = Runtime(Conductor(GRAPH, placement, max_concurrent_requests=4), placement, workers, Nowhere(),
                      sessions=SessionBook(4, 60, store_bytes=250))
    runtime.supervise(3)
    paint = WalkRequest("paint", {"x": torch.zeros(1)}, {"n": 1})
    deadline = time.monotonic() + TIMEOUT

    def run(session_id: str, leader: int, follower: int) -> None:
        runtime.submit(f"r-{session_id}", paint, Stream(), lambda event: None, session=SessionSpec(session_id))
        plan = workers.next_plan()
        results = [ItemResult(item.request_id, item.step) for item in plan.items]
        workers.pool._results.put(StepResult(
            0, plan.plan_id, results, session_bytes={session_id: leader},
            follower_session_bytes={1: {session_id: follower}},
            follower_gauges={1: {"painter.sessions_held": 1.0, "painter.session_bytes": float(follower)}}))
        while runtime.tracked or runtime.sessions.busy:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    try:
        run("s", 200, 120)
        assert runtime.sessions.held("s") == {0: 200, 1: 120}
        assert runtime.gauges()["rank1.painter.session_bytes"] == 120.0
        run("t", 100, 300)  # the follower's shard alone is over 250
        assert "t" not in runtime.sessions and "s" in runtime.sessions
        workers.pool._results.put(WorkerFailed(0, "rank 1 of its split node group failed: killed"))
        while "s" in runtime.sessions or not runtime.healthy:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert not any(name.startswith("rank1.") for name in runtime.gauges())
        with pytest.raises(RequestError) as err:
            runtime.submit("r2", paint, Stream(), lambda event: None, session=SessionSpec("s", resume=True))
        assert err.value.status == 410
    finally:
        runtime.close()
