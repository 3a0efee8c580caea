"""The conductor, driven with fabricated step results (no workers, sockets or torch).

Every test goes through ``Rig``: it submits requests, ticks the conductor, keeps the
plans each rank has in flight and answers them with chosen flags, finish reasons, errors
and emit counts. On every tick it checks the scheduling contract independently of the
conductor's own bookkeeping: one plan in flight per rank, nothing sent to a failed rank,
items on the rank the placement names, ``send``/``emit``/params/versions as specified,
no ready step left on an idle rank, FIFO admission within the limits, every request
finished once with its emit count, releases exactly once, after in-flight work, and only
on ranks the request touched.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from conductor_rig import GRAPH, STOP, Rig, two_ranks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mstar.graph import GraphError
from mstar.runtime.conductor import AdmissionError, Finished, RequestSpec
from mstar.runtime.placement import single_rank
from mstar.runtime.protocol import ItemResult, StepPlan, StepResult, VarRef, WorkItem

# ------------------------------------------------------------------ the chat walk


def test_chat_walk_prefill_then_decode_until_stop() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=10, temperature=0.5)
    d = rig.tick()
    [item] = d.plans[0].items
    assert item == WorkItem("a", "llm", "prefill", "llm.prefill", 0,
                            reads={"ids": VarRef("prompt", 0)}, writes={"tok": VarRef("tok", 1)},
                            send={}, emit={"tok": "text"}, params={"max_decode_steps": 10, "temperature": 0.5})
    assert d.plans[0].release == [] and d.finished == []

    d = rig.step()
    [item] = d.plans[0].items
    assert (item.op, item.step, item.iteration, item.params) == ("decode", "llm.decode", 0, None)
    assert item.reads == {"tok": VarRef("tok", 1)} and item.writes == {"tok": VarRef("tok", 2)}
    assert item.emit == {"tok": "text"} and item.send == {}

    d = rig.step()
    [item] = d.plans[0].items
    assert (item.iteration, item.reads["tok"].version, item.writes["tok"].version) == (1, 2, 3)

    d = rig.step(STOP)
    assert d.finished == [Finished("a", "stop", None, 3, {})]
    assert d.plans[0] == StepPlan(d.plans[0].plan_id, [], ["a"])
    assert [i.op for i in rig.items["a"]] == ["prefill", "decode", "decode"]
    rig.assert_quiescent()


def test_loop_ends_at_max_iters_and_reports_length() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=3)

    def last(item):
        return {"finish_reason": "length"} if item.op == "decode" and item.iteration == 2 else {}

    rig.drain(last)
    ops = [(i.op, i.iteration) for i in rig.items["a"]]
    assert ops == [("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2)]
    assert rig.finished["a"] == Finished("a", "length", None, 4, {})
    rig.assert_quiescent()


def test_max_iters_without_finish_reason_defaults_to_stop() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=2)
    rig.drain()
    assert [i.op for i in rig.items["a"]] == ["prefill", "decode", "decode"]
    assert rig.finished["a"].reason == "stop" and rig.finished["a"].error is None
    rig.assert_quiescent()


def test_stop_at_prefill_skips_the_loop() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=50)
    rig.tick()
    d = rig.step(STOP)
    assert rig.reasons(d) == {"a": "stop"}
    assert rig.releases(d) == ["a"] and rig.ops(d) == []
    assert [i.op for i in rig.items["a"]] == ["prefill"]
    rig.assert_quiescent()


def test_zero_decode_budget_skips_the_loop() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=0)
    rig.drain()
    assert [i.op for i in rig.items["a"]] == ["prefill"]
    assert rig.finished["a"].reason == "stop"
    rig.assert_quiescent()


def test_walk_with_nothing_to_do_finishes_at_once() -> None:
    """A walk whose cursor is done on admission (a Loop with a zero budget) must still
    finish, and never hold a slot or resources."""
    rig = Rig(max_concurrent=1, capacity={"kv": 4})
    rig.submit("empty", "paint", n=0, cost={"kv": 4})
    rig.submit("next", "paint", n=1, cost={"kv": 4})
    rig.drain()
    assert rig.finished["empty"] == Finished("empty", "stop", None, 0, {})
    assert rig.items["empty"] == []
    assert [i.step for i in rig.items["next"]] == ["painter.forward"]
    assert rig.finished["next"].reason == "stop" and rig.finished["next"].emitted == 1
    assert rig.released[("empty", 0)] == 1  # it ran nothing, but its inputs were sent to rank 0
    rig.assert_quiescent()


def test_emitted_counts_are_summed() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=3)
    counts = iter([2, 0, 5, 1])
    rig.drain(lambda item: {"emitted": next(counts)})
    assert rig.finished["a"].emitted == 8
    rig.assert_quiescent()


# ------------------------------------------------------------------ admission


def test_admission_by_max_concurrent_requests_is_fifo() -> None:
    rig = Rig(max_concurrent=2)
    for rid in "abcd":
        rig.submit(rid, max_decode_steps=5)
    d = rig.tick()
    assert rig.ops(d) == [("a", "prefill", 0), ("b", "prefill", 0)]
    assert [w.request_id for w in rig.c.waiting] == ["c", "d"]
    # b stops at prefill; c takes its place (in this tick or the next), d keeps waiting.
    d = rig.step(b=STOP)
    assert rig.reasons(d) == {"b": "stop"}
    if ("c", "prefill", 0) not in rig.ops(d):
        d = rig.step()
    assert ("c", "prefill", 0) in rig.ops(d)
    assert set(rig.c.live) == {"a", "c"} and [w.request_id for w in rig.c.waiting] == ["d"]
    rig.drain(STOP)
    assert rig.admitted == ["a", "b", "c", "d"]
    rig.assert_quiescent()


def test_admission_by_capacity_head_of_queue_is_never_overtaken() -> None:
    rig = Rig(capacity={"kv": 10})
    rig.submit("a", cost={"kv": 6})
    rig.submit("b", cost={"kv": 6})  # must wait for a
    rig.submit("c", cost={"kv": 3})  # would fit now, but b is first in line
    d = rig.tick()
    assert rig.ops(d) == [("a", "prefill", 0)]
    assert rig.c.in_use == {"kv": 6}
    for _ in range(3):  # a decodes; b and c keep waiting
        d = rig.step()
        assert [r for r, _, _ in rig.ops(d)] == ["a"]
        assert [w.request_id for w in rig.c.waiting] == ["b", "c"]
    d = rig.step(STOP)
    assert rig.reasons(d) == {"a": "stop"}
    if not rig.ops(d):
        d = rig.step()
    assert rig.ops(d) == [("b", "prefill", 0), ("c", "prefill", 0)]
    assert rig.c.in_use == {"kv": 9}
    rig.drain(STOP)
    assert rig.c.in_use == {"kv": 0}
    rig.assert_quiescent()


def test_request_needing_more_than_the_pool_is_rejected_at_submit() -> None:
    rig = Rig(capacity={"kv": 10})
    with pytest.raises(AdmissionError, match="whole pool"):
        rig.c.submit(RequestSpec("big", "chat", {"max_decode_steps": 1}, {"kv": 11}))
    with pytest.raises(AdmissionError, match="does not have"):
        rig.c.submit(RequestSpec("odd", "chat", {"max_decode_steps": 1}, {"gpu_seconds": 1}))
    assert not rig.c.waiting and rig.c.idle
    rig.submit("exact", cost={"kv": 10})  # exactly the whole pool is fine
    rig.drain(STOP)
    rig.assert_quiescent()


def test_admission_counts_cost_and_refuses_only_a_peak_bigger_than_the_pool() -> None:
    rig = Rig(capacity={"kv": 10})
    with pytest.raises(AdmissionError, match="needs 11 units of 'kv' but the whole pool holds 10"):
        rig.c.submit(RequestSpec("big", "chat", {"max_decode_steps": 1}, {"kv": 2}, peak={"kv": 11}))
    with pytest.raises(AdmissionError, match="does not have"):
        rig.c.submit(RequestSpec("odd", "chat", {"max_decode_steps": 1}, peak={"gpu_seconds": 1}))
    for rid in "abc":  # peaks of 10 each, admitted together on their prompts' 3 pages
        rig.submit(rid, cost={"kv": 3}, peak={"kv": 10})
    d = rig.tick()
    assert [r for r, _, _ in rig.ops(d)] == ["a", "b", "c"] and rig.c.in_use == {"kv": 9}
    rig.drain()
    rig.assert_quiescent()


def test_duplicate_request_id_and_unknown_walk_are_rejected() -> None:
    rig = Rig(max_concurrent=1)
    rig.submit("a")
    rig.submit("b")
    with pytest.raises(AdmissionError, match="already in use"):  # b is waiting
        rig.c.submit(RequestSpec("b", "chat", {"max_decode_steps": 1}))
    rig.tick()
    with pytest.raises(AdmissionError, match="already in use"):  # a is running
        rig.c.submit(RequestSpec("a", "chat", {"max_decode_steps": 1}))
    with pytest.raises(GraphError, match="unknown walk"):
        rig.c.submit(RequestSpec("c", "no-such-walk", {}))
    assert [w.request_id for w in rig.c.waiting] == ["b"] and set(rig.c.live) == {"a"}
    rig.drain(STOP)
    # once ended and released, the id may be used again
    rig.submit("a", max_decode_steps=1)
    rig.drain()
    assert rig.finished["a"].reason == "stop"
    rig.assert_quiescent()


# ----------------------------------------------------------- continuous batching


def test_continuous_batching_new_prefill_joins_running_decodes() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=10)
    rig.submit("b", max_decode_steps=10)
    d = rig.tick()
    assert rig.ops(d) == [("a", "prefill", 0), ("b", "prefill", 0)]
    d = rig.step()
    assert rig.ops(d) == [("a", "decode", 0), ("b", "decode", 0)]
    rig.submit("c", max_decode_steps=10)
    d = rig.step()
    assert rig.ops(d) == [("a", "decode", 1), ("b", "decode", 1), ("c", "prefill", 0)]
    assert [i.params is not None for i in d.plans[0].items] == [False, False, True]
    # one finishes in the middle of the batch; the rest go on in the same plan as its release
    d = rig.step(a=STOP)
    assert rig.reasons(d) == {"a": "stop"}
    assert rig.ops(d) == [("b", "decode", 2), ("c", "decode", 0)] and rig.releases(d) == ["a"]
    rig.drain(STOP)
    rig.assert_quiescent()


PREEMPTED = {"preempted": True}


def test_preempted_decode_runs_again_with_the_same_reads_and_iteration() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=3)
    rig.submit("b", max_decode_steps=3)
    rig.tick()
    d = rig.step()  # both prefilled
    [a1, b1] = d.plans[0].items
    d = rig.step(b=PREEMPTED)  # b's first decode gave back: nothing of it advanced
    [a2, b2] = d.plans[0].items
    assert (a2.iteration, b2.iteration) == (1, 0)
    assert b2.reads == b1.reads and b2.writes["tok"].version > b1.writes["tok"].version
    assert b2.params is None  # the rank has its params already
    assert rig.emitted["b"] == 1  # its prefill only
    d = rig.step(b=PREEMPTED)  # again: preemption may repeat
    assert [(r, i) for r, _, i in rig.ops(d)] == [("a", 2), ("b", 0)]
    rig.drain()
    assert [(i.op, i.iteration) for i in rig.items["b"]] == [
        ("prefill", 0), ("decode", 0), ("decode", 0), ("decode", 0), ("decode", 1), ("decode", 2)]
    assert rig.finished["b"].emitted == 4  # one per step that ran, none for the preempted ones
    rig.assert_quiescent()


def test_preempted_prefill_is_sent_again_and_the_request_keeps_its_admission() -> None:
    rig = Rig(capacity={"kv": 4})
    rig.submit("a", cost={"kv": 2}, max_decode_steps=1)
    rig.tick()
    d = rig.step(PREEMPTED)
    assert rig.ops(d) == [("a", "prefill", 0)] and rig.c.in_use == {"kv": 2}
    rig.drain()
    assert rig.finished["a"].reason == "stop" and rig.finished["a"].emitted == 2
    rig.assert_quiescent()


def test_cancel_of_a_request_whose_step_was_preempted() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=5)
    rig.tick()
    rig.cancel("a")
    d = rig.step(PREEMPTED)
    assert rig.reasons(d) == {"a": "cancelled"} and rig.releases(d) == ["a"]
    rig.assert_quiescent()


def test_busy_rank_gets_no_plan_until_its_result_arrives() -> None:
    rig = Rig()
    rig.submit("a")
    d = rig.tick()
    first = d.plans[0]
    rig.submit("b")
    rig.submit("c")
    rig.cancel("c")  # admitted but never dispatched: only its inputs to release
    for _ in range(3):
        d = rig.tick()
        assert d.plans == {}
    assert rig.reasons(d) == {} and rig.finished["c"].reason == "cancelled"
    # a stale result (not the plan in flight) does not free the rank
    rig.c.on_result(StepResult(0, first.plan_id + 1000))
    assert rig.tick().plans == {}
    rig.answer(0)
    d = rig.tick()
    assert rig.ops(d) == [("a", "decode", 0), ("b", "prefill", 0)]
    rig.drain(STOP)
    assert rig.released[("c", 0)] == 1  # the inputs the runtime sent at submit
    rig.assert_quiescent()


def test_results_of_release_only_plans_are_harmless() -> None:
    rig = Rig()
    rig.submit("a")
    rig.submit("b")
    rig.tick()
    d = rig.step(a=STOP)
    assert rig.releases(d) == ["a"]
    d = rig.step(b=STOP)
    assert rig.releases(d) == ["b"] and d.plans[0].items == []
    assert not rig.c.busy  # a release-only plan does not hold the rank
    for result in rig.release_only:  # the worker still answers them
        rig.c.on_result(result)
    rig.assert_quiescent()


# ------------------------------------------------------------- finish reasons


def test_step_error_fails_only_that_request() -> None:
    rig = Rig(capacity={"kv": 8})
    rig.submit("a", cost={"kv": 4})
    rig.submit("b", cost={"kv": 4})
    rig.tick()
    rig.step()
    d = rig.step(a={"error": "CUDA error: device-side assert"})
    assert d.finished == [Finished("a", "error", "CUDA error: device-side assert", 1, {})]
    assert rig.ops(d) == [("b", "decode", 1)] and rig.releases(d) == ["a"]
    assert rig.c.in_use == {"kv": 4}
    rig.drain(STOP)
    assert rig.finished["b"].reason == "stop"
    rig.assert_quiescent()


def test_cancel_waiting_request() -> None:
    rig = Rig(max_concurrent=1)
    rig.submit("a")
    rig.submit("b")
    rig.tick()
    rig.cancel("b")
    d = rig.tick()
    assert d.finished == [Finished("b", "cancelled", None, 0)]
    rig.drain(STOP)
    assert rig.items["b"] == []
    assert {rank for rid, rank in rig.released if rid == "b"} == {0}  # the rank holding its inputs
    rig.assert_quiescent()


def test_cancel_running_request_waits_for_its_work_in_flight() -> None:
    rig = Rig(capacity={"kv": 1})
    rig.submit("a", cost={"kv": 1})
    rig.tick()
    rig.step()  # decode 0 in flight
    rig.cancel("a")
    rig.cancel("a", "something else")  # a second cancel changes nothing
    d = rig.tick()
    assert d.finished == [] and d.plans == {}  # rank 0 still runs a's decode
    assert rig.c.in_use == {"kv": 1}
    d = rig.step({"emitted": 3})  # the late result still counts its emits
    assert d.finished == [Finished("a", "cancelled", None, 4, {})]
    assert d.plans[0] == StepPlan(d.plans[0].plan_id, [], ["a"])
    assert [i.op for i in rig.items["a"]] == ["prefill", "decode"]
    rig.assert_quiescent()


def test_cancel_with_reason_and_cancel_of_unknown_or_finished_request() -> None:
    rig = Rig()
    rig.cancel("ghost")
    rig.submit("a")
    rig.tick()
    rig.answer(0)
    rig.cancel("a", "stop")  # e.g. the frontend saw a stop string
    d = rig.tick()
    assert d.finished == [Finished("a", "stop", None, 1, {})]
    rig.cancel("a")
    assert rig.tick().finished == []
    rig.assert_quiescent()


def test_cancel_after_the_last_step_keeps_the_natural_reason() -> None:
    rig = Rig()
    rig.submit("a", max_decode_steps=1)
    rig.tick()
    rig.answer(0)
    rig.tick()
    rig.answer(0, {"finish_reason": "length"})  # the walk is done now
    rig.cancel("a")
    d = rig.tick()
    assert d.finished == [Finished("a", "length", None, 2, {})]
    rig.assert_quiescent()


def test_deadline_times_out_running_request_after_its_work_returns() -> None:
    rig = Rig(capacity={"kv": 2})
    rig.submit("a", deadline=5.0, cost={"kv": 2}, max_decode_steps=100)
    rig.tick(0.0)
    for t in range(1, 5):
        rig.answer(0)
        d = rig.tick(float(t))
        assert d.finished == [] and rig.ops(d)
    d = rig.tick(5.0)  # expired, but a decode is still in flight
    assert d.finished == [] and d.plans == {}
    rig.answer(0)
    d = rig.tick(5.5)
    assert [(f.request_id, f.reason) for f in d.finished] == [("a", "timeout")]
    assert d.finished[0].error and d.finished[0].emitted == 5
    assert rig.releases(d) == ["a"] and rig.c.in_use == {"kv": 0}
    rig.assert_quiescent()


def test_deadline_times_out_idle_running_request_at_once() -> None:
    rig = Rig()
    rig.submit("a", deadline=2.0)
    rig.submit("b")
    rig.tick(0.0)
    rig.answer(0, a={"emitted": 0})
    d = rig.tick(2.0)  # a has nothing in flight: it ends now, b goes on
    assert rig.reasons(d) == {"a": "timeout"}
    assert rig.ops(d) == [("b", "decode", 0)] and rig.releases(d) == ["a"]
    rig.drain(STOP)
    rig.assert_quiescent()


def test_deadline_times_out_waiting_request() -> None:
    rig = Rig(max_concurrent=1)
    rig.submit("a")
    rig.submit("b", deadline=3.0)
    rig.submit("c")
    rig.tick(0.0)
    d = rig.tick(2.9)
    assert d.finished == []
    d = rig.tick(3.0)
    assert [(f.request_id, f.reason, f.emitted) for f in d.finished] == [("b", "timeout", 0)]
    assert "queue" in d.finished[0].error
    rig.now = 3.0
    rig.drain(STOP)
    assert rig.items["b"] == [] and rig.admitted == ["a", "c"]
    rig.assert_quiescent()


# ------------------------------------------------------------- two ranks


def test_two_rank_walk_sends_encoder_output_to_the_llm_rank() -> None:
    rig = Rig(two_ranks())
    rig.submit("v", "vision", max_decode_steps=2)
    d = rig.tick()
    assert set(d.plans) == {0}
    [enc] = d.plans[0].items
    assert enc == WorkItem("v", "encoder", "forward", "encoder.forward", 0,
                           reads={"image": VarRef("image", 0)}, writes={"out": VarRef("emb", 1)},
                           send={"out": [1]}, emit={}, params={"max_decode_steps": 2})
    d = rig.step()
    assert set(d.plans) == {1}
    [pre] = d.plans[1].items
    assert pre == WorkItem("v", "llm", "prefill", "llm.prefill", 0,
                           reads={"ids": VarRef("prompt", 0), "embeds": VarRef("emb", 1)},
                           writes={"tok": VarRef("tok", 2)}, send={}, emit={"tok": "text"},
                           params={"max_decode_steps": 2})  # first contact with rank 1
    d = rig.step()
    [dec] = d.plans[1].items
    assert (dec.params, dec.reads, dec.writes) == (None, {"tok": VarRef("tok", 2)}, {"tok": VarRef("tok", 3)})
    rig.step()
    d = rig.step()
    assert rig.reasons(d) == {"v": "stop"}
    assert rig.releases(d, 0) == ["v"] and rig.releases(d, 1) == ["v"]
    rig.assert_quiescent()


def test_release_on_the_ranks_that_hold_something_of_the_request() -> None:
    """A request is released where it ran a step and where its walk's variables are sent
    (its inputs arrive there at submit), and nowhere else."""
    rig = Rig(two_ranks())
    rig.submit("t", "chat", max_decode_steps=1)  # llm only: rank 1
    rig.submit("v", "vision", max_decode_steps=1)
    d = rig.tick()
    assert rig.ops(d, 0) == [("v", "encoder.forward", 0)] and rig.ops(d, 1) == [("t", "prefill", 0)]
    rig.cancel("v")  # encoder in flight: v ran on rank 0 only, but rank 1 holds its prompt
    d = rig.step()
    assert rig.reasons(d) == {"v": "cancelled"}
    assert rig.releases(d, 0) == ["v"] and rig.releases(d, 1) == ["v"]  # rank 1 with t's decode
    d = rig.step()
    assert rig.reasons(d) == {"t": "stop"}
    assert rig.releases(d, 1) == ["t"] and 0 not in d.plans
    rig.assert_quiescent()
    assert rig.released == Counter({("v", 0): 1, ("v", 1): 1, ("t", 1): 1})


def test_release_waits_until_the_touched_rank_is_free() -> None:
    rig = Rig(two_ranks())
    rig.submit("a", "vision", max_decode_steps=5)
    rig.tick()
    rig.step()  # a's prefill on rank 1
    rig.submit("b", "vision", max_decode_steps=5)
    d = rig.tick()
    assert rig.ops(d, 0) == [("b", "encoder.forward", 0)]
    rig.answer(1, STOP)  # a ends; rank 0 still runs b's encoder
    d = rig.tick()
    assert rig.reasons(d) == {"a": "stop"}
    assert rig.releases(d, 1) == ["a"] and 0 not in d.plans
    rig.answer(0)
    d = rig.tick()
    assert d.plans[0] == StepPlan(d.plans[0].plan_id, [], ["a"])
    assert rig.ops(d, 1) == [("b", "prefill", 0)]
    rig.drain(STOP)
    rig.assert_quiescent()


# ------------------------------------------------------------- parallel walk


def test_parallel_branches_share_a_plan_and_the_join_reads_both() -> None:
    rig = Rig()
    rig.submit("p", "fork", seed=7)
    d = rig.tick()
    left, right = d.plans[0].items
    assert (left.step, right.step) == ("left.forward", "right.forward")
    assert left.reads == right.reads == {"x": VarRef("x", 0)}
    assert left.writes == {"y": VarRef("ya", 1)} and right.writes == {"y": VarRef("yb", 2)}
    assert left.params == {"seed": 7} and right.params is None  # once per rank, even in one plan
    d = rig.step()
    [join] = d.plans[0].items
    assert join.reads == {"a": VarRef("ya", 1), "b": VarRef("yb", 2)}
    assert join.writes == {"z": VarRef("z", 3)} and join.emit == {"z": "image"} and join.send == {}
    d = rig.step()
    assert d.finished == [Finished("p", "stop", None, 1, {})]
    rig.assert_quiescent()


def test_parallel_branches_on_two_ranks_join_waits_for_both() -> None:
    rig = Rig(two_ranks())
    rig.submit("p", "fork")
    d = rig.tick()
    [left] = d.plans[0].items
    [right] = d.plans[1].items
    assert left.send == {"y": [1]} and right.send == {}  # join runs on rank 1
    assert left.params is not None and right.params is not None
    rig.answer(0)
    assert rig.tick().plans == {}  # right still running: no join yet
    rig.answer(1)
    d = rig.tick()
    [join] = d.plans[1].items
    assert join.params is None and join.reads == {"a": VarRef("ya", 1), "b": VarRef("yb", 2)}
    d = rig.step()
    assert rig.reasons(d) == {"p": "stop"}
    assert rig.releases(d, 0) == ["p"] and rig.releases(d, 1) == ["p"]
    rig.assert_quiescent()


def test_error_in_one_branch_waits_for_the_other_before_release() -> None:
    rig = Rig(two_ranks(), capacity={"kv": 1})
    rig.submit("p", "fork", cost={"kv": 1})
    rig.tick()
    rig.answer(0, {"error": "left exploded"})
    d = rig.tick()
    assert d.finished == [] and d.plans == {}  # right is still in flight on rank 1
    assert rig.c.in_use == {"kv": 1}
    rig.answer(1)
    d = rig.tick()
    assert d.finished == [Finished("p", "error", "left exploded", 0, {})]
    assert rig.releases(d, 0) == ["p"] and rig.releases(d, 1) == ["p"]
    assert all(i.step != "join.forward" for i in rig.items["p"])
    rig.assert_quiescent()


# ------------------------------------------------------------- rank failure


def test_rank_failure_fails_requests_that_touched_it_and_nothing_is_sent_there() -> None:
    rig = Rig(two_ranks(), capacity={"kv": 10})
    rig.submit("a", "vision", cost={"kv": 2})
    rig.tick()
    rig.step()  # a's prefill runs on rank 1
    rig.submit("b", "vision", cost={"kv": 2})
    rig.submit("p", "fork", cost={"kv": 2})
    d = rig.tick()  # rank 0: b's encoder and p's left; rank 1 busy with a
    assert rig.ops(d, 0) == [("b", "encoder.forward", 0), ("p", "left.forward", 0)]
    rig.fail_rank(1, "out of memory")
    d = rig.tick()
    assert [(f.request_id, f.reason) for f in d.finished] == [("a", "error")]
    assert "rank 1" in d.finished[0].error and "out of memory" in d.finished[0].error
    assert 1 not in d.plans and 0 not in d.plans  # rank 0 still busy; its release waits
    rig.answer(0)
    # b and p never touched rank 1, but their next steps need it: they must fail, not hang
    for _ in range(3):
        rig.tick()
        rig.answer_all()
    for rid in "bp":
        assert rig.finished[rid].reason == "error" and "rank 1" in rig.finished[rid].error
    # a request arriving later that needs rank 1 fails too; rank 0 alone still serves
    rig.submit("c", "chat")
    rig.submit("e", "paint", n=1)
    rig.drain()
    assert rig.finished["c"].reason == "error" and rig.items["c"] == []
    assert rig.finished["e"].reason == "stop"
    assert rig.released[("a", 1)] == 0 and rig.released[("a", 0)] == 1
    rig.assert_quiescent()


def test_rank_failure_drops_releases_still_owed_to_it_and_ignores_its_late_results() -> None:
    rig = Rig(two_ranks())
    rig.submit("a", "chat")
    rig.submit("b", "chat")
    rig.tick()
    rig.answer(1, a=STOP)  # a ends
    d = rig.tick()
    assert rig.releases(d, 1) == ["a"]
    plan = rig.outstanding[1]
    assert [i.request_id for i in plan.items] == ["b"]
    rig.cancel("b")
    late = StepResult(1, plan.plan_id, [ItemResult("b", "llm.decode", emitted=1)])
    rig.fail_rank(1, "lost")
    d = rig.tick()
    assert rig.reasons(d) == {"b": "cancelled"}  # it was cancelled before the failure
    rig.c.on_result(late)  # the dead rank's result turns up anyway
    d = rig.tick()
    assert d.finished == [] and d.plans == {}
    assert rig.c.idle
    rig.assert_quiescent()


def test_rank_failure_while_a_release_is_pending_there_leaves_the_conductor_idle() -> None:
    rig = Rig(two_ranks())
    rig.submit("a", "vision", max_decode_steps=3)
    rig.tick()
    rig.step()  # a on rank 1 now
    rig.submit("b", "vision", max_decode_steps=3)
    rig.tick()  # b's encoder busies rank 0
    rig.answer(1, STOP)
    d = rig.tick()
    assert rig.reasons(d) == {"a": "stop"} and 0 not in d.plans  # a's release owed to rank 0
    rig.fail_rank(0, "gone")
    d = rig.tick()
    assert rig.reasons(d) == {"b": "error"}
    assert not rig.c.releases.get(0)
    rig.assert_quiescent()


# ------------------------------------------------------------- randomized


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 14))
    requests = []
    for i in range(n):
        walk = draw(st.sampled_from(["chat", "chat", "vision", "fork", "paint"]))
        requests.append(dict(
            rid=f"r{i}",
            walk=walk,
            arrive=draw(st.integers(0, 12)),
            budget=draw(st.integers(0, 6)),
            stop_at=draw(st.one_of(st.none(), st.integers(0, 7))),
            cost=draw(st.integers(0, 5)),
            cancel_at=draw(st.one_of(st.none(), st.integers(0, 25))),
            error_at=draw(st.one_of(st.none(), st.integers(0, 8))),
            deadline=draw(st.one_of(st.none(), st.integers(1, 40))),
        ))
    return dict(
        requests=requests,
        two_ranks=draw(st.booleans()),
        max_concurrent=draw(st.integers(1, 6)),
        capacity=draw(st.integers(5, 12)),
        fail=draw(st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, 30)))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_traffic_every_request_finishes_once_and_resources_return(sc) -> None:
    rng = random.Random(sc["seed"])
    placement = two_ranks() if sc["two_ranks"] else single_rank(GRAPH)
    rig = Rig(placement, max_concurrent=sc["max_concurrent"], capacity={"kv": sc["capacity"]})
    reqs = {r["rid"]: r for r in sc["requests"]}
    count: Counter[str] = Counter()  # items answered per request
    cancelled: set[str] = set()
    preempted: set[tuple[str, int]] = set()  # (request, version its step would have written)

    def behave(item: WorkItem) -> dict:
        r = reqs[item.request_id]
        if item.node == "llm" and rng.random() < 0.15:  # the engine gives the step back unrun
            preempted.add((item.request_id, item.writes["tok"].version))
            return {"preempted": True}
        k = count[item.request_id]
        count[item.request_id] += 1
        if r["error_at"] is not None and k == r["error_at"]:
            return {"error": f"failed at item {k}"}
        out: dict = {"emitted": rng.randint(0, 2)}
        if item.node == "llm":
            llm_step = 0 if item.op == "prefill" else item.iteration + 1
            if r["stop_at"] == llm_step:
                out.update(flags=["stop"], finish_reason="stop")
            elif item.op == "decode" and item.iteration == r["budget"] - 1:
                out["finish_reason"] = "length"
        return out

    def submit_due(t: int) -> None:
        for r in sc["requests"]:
            if r["arrive"] == t:
                params = {"max_decode_steps": r["budget"]} if r["walk"] in ("chat", "vision") else {}
                if r["walk"] == "paint":
                    params = {"n": r["budget"] % 3}
                deadline = None if r["deadline"] is None else float(t + r["deadline"])
                rig.submit(r["rid"], r["walk"], cost={"kv": r["cost"]}, deadline=deadline, **params)

    for t in range(2000):
        rig.now = float(t)
        submit_due(t)
        if sc["fail"] is not None and sc["fail"][1] == t:
            rig.fail_rank(sc["fail"][0] % len(placement.ranks), "injected")
        rig.tick()
        for r in sc["requests"]:  # between two ticks, as the runtime loop takes commands before its wait
            if r["cancel_at"] == t and r["rid"] in rig.specs:
                rig.cancel(r["rid"])
                if r["rid"] not in rig.finished:
                    cancelled.add(r["rid"])
        rig.settle()  # the runtime loop's wait for the next event: never in a spin, never past work
        for rank in sorted(rig.outstanding):
            if rng.random() < 0.75:
                rig.answer(rank, behave)
        if rng.random() < 0.3:  # the worker's answers to release-only plans, late
            for result in rig.release_only:
                rig.c.on_result(result)
            rig.release_only.clear()
        if t > 12 and not rig.outstanding and rig.c.idle:
            break
    else:
        raise AssertionError("traffic did not drain")

    rig.assert_quiescent()
    assert set(rig.finished) == set(reqs)
    for rid, r in reqs.items():
        done = rig.finished[rid]
        event(f"finish reason {done.reason}")
        assert done.reason in ("stop", "length", "error", "cancelled", "timeout"), done
        assert (done.error is not None) == (done.reason in ("error", "timeout")), done
        if done.reason == "cancelled":
            assert rid in cancelled
        if done.reason == "timeout":
            assert r["deadline"] is not None
        if done.reason == "error" and "injected" not in (done.error or ""):
            assert r["error_at"] is not None and done.error == f"failed at item {r['error_at']}"
        if done.reason in ("stop", "length") and r["walk"] in ("chat", "vision"):
            # the walk ran to its natural end: the loop stopped by flag or by budget
            decodes = [i for i in rig.items[rid]
                       if i.op == "decode" and (rid, i.writes["tok"].version) not in preempted]
            budget, stop_at = r["budget"], r["stop_at"]
            natural = min(stop_at, budget) if stop_at is not None else budget
            assert len(decodes) == natural, (rid, len(decodes), natural)
            assert [i.iteration for i in decodes] == list(range(natural))
            expected = "stop" if (stop_at is not None and stop_at <= budget) or budget == 0 else "length"
            assert done.reason == expected, (rid, done.reason, expected)
        if r["walk"] == "fork" and done.reason == "stop":
            assert [i.step for i in rig.items[rid]][-1] == "join.forward"
