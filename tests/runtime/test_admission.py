"""The bounded wait queue (AdmissionGate), the ``max_queue_size`` config key, and the
statuses a failed request maps to (504 timeout, 503 dead worker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from test_conductor import GRAPH

from mstar.config import ConfigError, parse_config
from mstar.contract import Overloaded
from mstar.runtime.admission import AdmissionGate
from mstar.runtime.conductor import Conductor, Finished, RequestSpec
from mstar.runtime.placement import single_rank
from mstar.runtime.protocol import ItemResult, StepResult
from mstar.runtime.runtime import _error_status


@dataclass
class FakeConductor:
    max_concurrent: int
    num_live: int = 0
    num_waiting: int = 0


def test_gate_refuses_past_the_queue_once_the_slots_are_taken() -> None:
    conductor = FakeConductor(max_concurrent=2)
    gate = AdmissionGate(conductor, max_queue_size=3, retry_after_s=2)  # type: ignore[arg-type]
    for _ in range(5):  # 2 free slots + 3 queue places, before the loop thread saw any
        gate.enter()
    assert gate.waiting == 5 and gate.backlog() == 3
    with pytest.raises(Overloaded) as info:
        gate.enter()
    assert info.value.status == 429 and info.value.retry_after_s == 2
    assert "2 requests running and 3 waiting" in info.value.message
    # the loop thread hands them to the conductor, which admits two
    for _ in range(5):
        gate.handed_over()
    conductor.num_waiting, conductor.num_live = 3, 2
    assert gate.waiting == 3 and gate.backlog() == 3
    with pytest.raises(Overloaded):
        gate.enter()
    conductor.num_waiting, conductor.num_live = 2, 2  # one admitted after a request ended
    gate.enter()
    assert gate.waiting == 3
    gate.withdraw()
    assert gate.waiting == 2


def test_gate_without_a_limit_and_with_a_zero_queue() -> None:
    unbounded = AdmissionGate(FakeConductor(max_concurrent=1), max_queue_size=None)  # type: ignore[arg-type]
    for _ in range(100):
        unbounded.enter()
    strict = AdmissionGate(FakeConductor(max_concurrent=1), max_queue_size=0)  # type: ignore[arg-type]
    strict.enter()  # takes the free slot
    with pytest.raises(Overloaded):
        strict.enter()


def test_max_queue_size_config() -> None:
    assert parse_config({"model": "smollm2"}).queue_limit == 4 * 16
    assert parse_config({"model": "smollm2", "max_concurrent_requests": 3}).queue_limit == 12
    assert parse_config({"model": "smollm2", "max_queue_size": 0}).queue_limit == 0
    assert parse_config({"model": "smollm2", "max_queue_size": 500}).queue_limit == 500
    for bad in (-1, "many", 1.5):
        with pytest.raises(ConfigError, match="max_queue_size"):
            parse_config({"model": "smollm2", "max_queue_size": bad})


def test_conductor_counts_and_names_the_failed_rank() -> None:
    conductor = Conductor(GRAPH, single_rank(GRAPH), max_concurrent_requests=1)
    conductor.submit(RequestSpec("a", "chat", {}))
    conductor.submit(RequestSpec("b", "chat", {}))
    assert (conductor.num_waiting, conductor.num_live) == (2, 0)
    d = conductor.tick(0.0)
    assert (conductor.num_waiting, conductor.num_live) == (1, 1)
    conductor.on_rank_failed(0, "worker process mstar-worker-0 (pid 7) was killed by SIGKILL")
    finished = {f.request_id: f for f in conductor.tick(0.1).finished}
    late = StepResult(0, d.plans[0].plan_id, [ItemResult("a", "llm.prefill", emitted=1)])
    conductor.on_result(late)
    finished |= {f.request_id: f for f in conductor.tick(0.2).finished}
    assert set(finished) == {"a", "b"}  # b needed the dead rank too: it fails, never waits
    for done in finished.values():
        assert done.reason == "error" and done.failed_rank == 0 and "pid 7" in done.error
        assert _error_status(done) == 503


def test_error_status_of_finished_requests() -> None:
    assert _error_status(Finished("a", "timeout", "request timed out", 3)) == 504
    assert _error_status(Finished("a", "error", "RuntimeError: boom", 0)) is None  # a plain 500
    assert _error_status(None) is None
