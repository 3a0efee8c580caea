"""Telling a lost rank from a busy one, and telling its peers to stop waiting for it.

* ``HeartbeatSender`` beats from its own thread while the main thread is busy in torch,
  and stops once ``attached()`` turns false.
* ``ProcessWorkers`` with ``lost_after_s`` (fake workers: threads that report ready, then
  only beat): a rank that beats but sends no result for longer than the limit stays; one
  that stops beating is reported lost, once.
* A ``Worker`` waiting for an input that a dead rank would have sent gives up as soon as
  the frontend's abandon notice for its request arrives, not at the input timeout.
"""

from __future__ import annotations

import threading
import time

import torch
import zmq

from mstar.engine.base import StatelessEngine
from mstar.runtime import protocol
from mstar.runtime.heartbeat import HeartbeatSender
from mstar.runtime.protocol import Heartbeat, StepPlan, VarRef, WorkerFailed, WorkerReady, WorkItem
from mstar.runtime.transport import make_transport
from mstar.runtime.transport.inproc import InProcessHub
from mstar.runtime.worker import Worker
from mstar.runtime.workers import ProcessWorkers


def _beats(sock: zmq.Socket, seconds: float) -> list[float]:
    """When each heartbeat arrived over ``seconds``."""
    arrived, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            assert isinstance(protocol.decode(sock.recv()), Heartbeat)
            arrived.append(time.monotonic())
    return arrived


def test_heartbeats_go_on_while_the_main_thread_is_busy_and_stop_when_detached() -> None:
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    attached = threading.Event()
    attached.set()
    sender = HeartbeatSender(ctx, f"tcp://127.0.0.1:{port}", 3, period_s=0.1, attached=attached.is_set)
    got: list[float] = []
    listener = threading.Thread(target=lambda: got.extend(_beats(pull, 1.5)))
    listener.start()
    a = torch.randn(256, 256)
    busy_until = time.monotonic() + 1.2
    while time.monotonic() < busy_until:  # a long "step": the main thread never sleeps
        a = torch.tanh(a @ a)
    listener.join()
    assert len(got) >= 8, got
    assert max(b - a for a, b in zip(got, got[1:])) < 0.5
    attached.clear()
    sender._thread.join(timeout=5)  # it stops at its next beat, however late a busy machine runs it
    assert not sender._thread.is_alive()
    _beats(pull, 0.2)  # drain the beats sent before it saw the detach
    assert _beats(pull, 0.5) == []
    sender.close()
    pull.close(linger=0)


class _FakeRank:
    """A worker thread's handle: it reports ready, then only beats until ``stop_beating``."""

    def __init__(self, rank: int, result_addr: str):
        self.name, self.pid, self.exitcode = f"fake-{rank}", None, None
        self.beating = threading.Event()
        self.beating.set()
        ctx = zmq.Context.instance()
        results = ctx.socket(zmq.PUSH)
        results.connect(result_addr)
        results.send(protocol.encode(WorkerReady(rank, "unused")))
        results.close(linger=1000)
        self.heartbeat = HeartbeatSender(ctx, result_addr, rank, period_s=0.1, attached=self.beating.is_set)

    def is_alive(self) -> bool:
        return True  # as a Ray actor on a lost node looks to its handle

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        self.beating.clear()


class _FakeWorkers(ProcessWorkers):
    lost_after_s = 1.0

    def _start(self, rank: int, plan_addr: str, result_addr: str, rendezvous: str | None) -> _FakeRank:
        return _FakeRank(rank, result_addr)

    def _publish_peers(self) -> None:
        pass


def test_a_silent_rank_is_lost_and_a_busy_one_is_not() -> None:
    frontend = make_transport("tcp", 2)
    pool = _FakeWorkers({}, 2, "tcp", frontend)
    try:
        quiet_until = time.monotonic() + 2.5  # 2.5 x the limit without a result: busy, not lost
        while time.monotonic() < quiet_until:
            assert pool.poll(0.1) == []
        pool.ranks[1].proc.beating.clear()
        stopped = time.monotonic()
        events: list = []
        while not events and time.monotonic() - stopped < 5:
            events = pool.poll(0.1)
        took = time.monotonic() - stopped
        assert [type(e) for e in events] == [WorkerFailed] and events[0].rank == 1, events
        assert "no heartbeat for 1." in events[0].error, events[0].error
        assert 0.8 < took < 2.5, took  # the last beat came up to one period before
        for _ in range(10):  # reported once; rank 0 still fine
            assert pool.poll(0.05) == []
    finally:
        for process in pool.ranks.values():
            process.proc.heartbeat.close()
        pool.close()
        frontend.close()


def test_a_worker_waiting_for_a_dead_ranks_input_gives_up_on_the_abandon_notice() -> None:
    hub = InProcessHub()
    transports = {rank: make_transport("inproc", rank, hub=hub) for rank in (0, 1, 2)}
    for rank, transport in transports.items():
        transport.connect({r: t.address for r, t in transports.items() if r != rank})
    engine = StatelessEngine(lambda op, items: [{"y": item.inputs["x"] + 1} for item in items])
    worker = Worker(1, {"codec": engine}, transports[1], frontend_rank=2)
    item = WorkItem("req-a", "codec", "run", "decode", 0, reads={"x": VarRef("codes", 3)},
                    writes={"y": VarRef("audio", 1)})
    threading.Timer(0.3, lambda: transports[2].send(1, protocol.abandon_key(0, ["req-a", "req-b"]), {})).start()
    started = time.monotonic()
    result = worker.execute(StepPlan(1, [item]))
    assert time.monotonic() - started < 2.0
    assert result.results[0].error == "gave up waiting for inputs: worker rank 0 was declared dead"
    for transport in transports.values():
        transport.close()
