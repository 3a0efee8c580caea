"""The runtime's conductor loop against workers whose steps the test finishes by hand:
requests that arrive while a step runs go into the very next plan, and a submission ends
the loop's wait for worker events at once (the loop never sits on a request it could plan)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from mstar.contract import RequestError
from mstar.model.spec import WalkRequest
from mstar.runtime.conductor import Conductor
from mstar.runtime.placement import single_rank
from mstar.runtime.protocol import ItemResult, StepPlan, StepResult
from mstar.runtime.runtime import Runtime
from mstar.runtime.workers import InProcessWorkers
from tests.runtime.conductor_rig import GRAPH

TIMEOUT = 5.0


class HeldWorkers:
    """Rank 0 of the rig graph: every plan is kept until ``finish`` answers it. ``poll``
    waits on the same queue an in-process pool uses, so ``wake`` is the pool's own."""

    def __init__(self) -> None:
        self.pool = InProcessWorkers({})
        self.plans: queue.SimpleQueue[StepPlan] = queue.SimpleQueue()
        self.polls: list[float] = []  # each poll's timeout, as the loop asked

    def send(self, rank: int, plan: StepPlan) -> None:
        self.plans.put(plan)

    def poll(self, timeout: float):
        self.polls.append(timeout)
        return self.pool.poll(timeout)

    def wake(self) -> None:
        self.pool.wake()

    def stats(self):
        return {0: {}}

    def close(self) -> None:
        pass

    def next_plan(self) -> StepPlan:
        while True:
            plan = self.plans.get(timeout=TIMEOUT)
            if plan.items:
                return plan

    def finish(self, plan: StepPlan) -> None:
        """Answer the plan: each prefill or decode wrote its token and streamed nothing."""
        results = [ItemResult(item.request_id, item.step) for item in plan.items]
        self.pool._results.put(StepResult(0, plan.plan_id, results))


class Nowhere:
    """A frontend transport that takes the submitted inputs and never delivers an emit."""

    def send(self, rank, key, value) -> None:
        pass

    def recv(self, timeout: float):
        time.sleep(timeout)
        return []

    def close(self) -> None:
        pass


class Stream:
    stopped = False
    media_seconds = None
    generated = 0

    def feed(self, modality, value):
        return None

    def finish(self, reason):
        return None


@pytest.fixture
def loop():
    placement = single_rank(GRAPH)
    workers = HeldWorkers()
    runtime = Runtime(Conductor(GRAPH, placement, max_concurrent_requests=8), placement, workers, Nowhere())
    yield runtime, workers
    runtime.close()


def submit(runtime: Runtime, request_id: str) -> None:
    request = WalkRequest("chat", {"prompt": torch.tensor([1, 2])}, {"max_decode_steps": 3})
    runtime.submit(request_id, request, Stream(), lambda event: None)


def test_requests_arriving_during_a_step_join_the_next_plan(loop):
    runtime, workers = loop
    runtime._poll_timeout = lambda: 30.0  # no tick comes round on its own
    submit(runtime, "a")
    first = workers.next_plan()
    assert [(i.request_id, i.op) for i in first.items] == [("a", "prefill")]
    # While that step runs, two more arrive; the loop waits on the step's result meanwhile.
    submit(runtime, "b")
    submit(runtime, "c")
    time.sleep(0.1)
    assert workers.plans.empty()  # the rank is busy: nothing may be sent yet
    workers.finish(first)
    second = workers.next_plan()
    assert sorted((i.request_id, i.op) for i in second.items) == [("a", "decode"), ("b", "prefill"),
                                                                   ("c", "prefill")]


def test_an_id_in_use_is_refused_and_an_ended_one_runs_under_a_fresh_id(loop):
    runtime, workers = loop
    submit(runtime, "a")
    first = workers.next_plan()
    with pytest.raises(RequestError) as err:
        submit(runtime, "a")  # still running: refused, and "a" is left alone
    assert err.value.field == "request_id" and err.value.status == 409
    assert list(runtime.tracked) == ["a"]
    runtime.cancel("a")
    workers.finish(first)
    deadline = time.monotonic() + TIMEOUT
    while runtime.tracked:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    # The workers may still drop late inputs of the ended "a": the new "a" gets an id of its own
    submit(runtime, "a")
    again = workers.next_plan()
    [item] = again.items
    assert item.op == "prefill" and item.request_id != "a" and item.request_id.startswith("a#")
    runtime.cancel("a")  # the caller's id reaches the runtime's
    workers.finish(again)
    while runtime.tracked:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_the_id_is_free_when_the_client_hears_the_end(loop):
    """A client that sends its next request under the same id the moment the last one's end
    reaches it is not refused: the id is released before the end is delivered (it was after,
    and a quick resubmission met a 409 now and then)."""
    runtime, workers = loop
    heard: list[object] = []

    def sink(event) -> None:
        if event is not None and event.finish_reason is not None:
            try:
                submit(runtime, "a")
                heard.append("resubmitted")
            except RequestError as err:
                heard.append(err)

    request = WalkRequest("chat", {"prompt": torch.tensor([1, 2])}, {"max_decode_steps": 3})
    runtime.submit("a", request, Stream(), sink)
    first = workers.next_plan()
    runtime.cancel("a")
    workers.finish(first)
    deadline = time.monotonic() + TIMEOUT
    while not heard:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert heard == ["resubmitted"]
    runtime.cancel("a")
    workers.finish(workers.next_plan())


def test_a_submission_ends_the_wait_for_worker_events(loop):
    runtime, workers = loop
    runtime._poll_timeout = lambda: 30.0  # a wait only a worker event or a wake can end
    submit(runtime, "a")
    workers.finish(workers.next_plan())
    workers.next_plan()  # a's decode, left running: the loop waits for its result
    deadline = time.monotonic() + TIMEOUT
    while len(workers.polls) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    start = time.monotonic()
    submit(runtime, "b")
    while len(workers.polls) < 4:  # the loop came round: the waiting poll returned
        assert time.monotonic() - start < TIMEOUT
        time.sleep(0.001)


def test_a_process_pool_poll_returns_when_woken():
    from types import SimpleNamespace

    from mstar.runtime.workers import ProcessWorkers

    frontend = SimpleNamespace(address="inproc://unused", connect=lambda peers: None)
    pool = ProcessWorkers({}, 0, "zmq", frontend)  # no ranks: only the wake socket to poll
    try:
        start = time.monotonic()
        assert pool.poll(0.05) == [] and time.monotonic() - start >= 0.04  # nothing to wake it
        threading.Timer(0.05, pool.wake).start()
        start = time.monotonic()
        assert pool.poll(30.0) == []
        assert time.monotonic() - start < TIMEOUT
        pool.wake()
        pool.wake()
        start = time.monotonic()
        assert pool.poll(0.0) == [] and pool.poll(0.05) == []  # the wakes were taken together
        assert time.monotonic() - start >= 0.04
    finally:
        pool.close()
    pool.wake()  # after close: nothing to wake, and no error
