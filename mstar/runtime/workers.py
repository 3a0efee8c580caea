"""The worker side of the runtime: worker ranks in this process, or one process per rank.

Both pools present the same calls to the runtime loop: ``send(rank, plan)``,
``poll(timeout)`` for step results and failures, ``stats()`` (each rank's engine gauges
before any work; later ones ride on every ``StepResult``) and ``close()``. The process
pool can also ``restart`` a rank whose process died.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from mstar.runtime import protocol
from mstar.runtime.protocol import PeerTable, Shutdown, StepPlan, StepResult, WorkerFailed, WorkerReady
from mstar.runtime.transport import make_transport
from mstar.runtime.worker import Worker

log = logging.getLogger(__name__)

Event = StepResult | WorkerFailed

PARENT_CHECK_MS = 1000  # how often an idle worker process checks that its server still lives


def build_worker(config_data: dict[str, Any], rank: int, transport, frontend_rank: int) -> Worker:
    """Load the model parts placed on ``rank`` and wrap them in a Worker."""
    from mstar.config import parse_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    config = parse_config(config_data)
    spec = model_class(config.model)(config)
    placement = build_placement(spec.graph(), config)
    device = config.device_of(rank)
    engines = spec.build_engines(placement.nodes_on(rank), device)
    graph = spec.graph()
    stream_vars = frozenset(edge.source for walk in graph.walks.values() for edge in walk.streams)
    return Worker(rank, engines, transport, frontend_rank, stream_vars)


class InProcessWorkers:
    """Every rank in this process; plans run synchronously inside ``send`` (deterministic)."""

    def __init__(self, workers: dict[int, Worker]):
        self.workers = workers
        self._results: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def send(self, rank: int, plan: StepPlan) -> None:
        try:
            self._results.put(self.workers[rank].execute(plan))
        except Exception as err:  # a bug in the worker itself: that rank is gone
            log.exception("worker %d failed", rank)
            self._results.put(WorkerFailed(rank, f"{type(err).__name__}: {err}"))

    def poll(self, timeout: float) -> list[Event]:
        out: list[Event] = []
        try:
            out.append(self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            return out

    def stats(self) -> dict[int, dict[str, float]]:
        return {rank: worker.stats() for rank, worker in self.workers.items()}

    def close(self) -> None:
        for worker in self.workers.values():
            worker.transport.close()


@dataclass
class _Process:
    """One worker process of a rank and its own control sockets. A restart makes a new one
    (new sockets too), so nothing a dead process sent can pass for its successor's."""

    proc: mp.process.BaseProcess
    plans: zmq.Socket  # PUSH, bound here; the process connects
    results: zmq.Socket  # PULL, bound here; the process connects
    deadline: float  # when it must have reported ready
    ready: bool = False
    failed: bool = False
    on_ready: Callable[[int, dict[str, float]], None] | None = None  # set by a restart


class ProcessWorkers:
    """One spawned process per rank, driven over ZeroMQ (plans down, results up).

    ``restart(rank, on_ready)`` replaces a dead rank's process without blocking: the new
    one loads its engines while the others keep working; once it reports ready, every rank
    and the frontend transport get the new peer table and ``on_ready(rank, gauges)`` runs
    (inside ``poll``, on the caller's thread). A restarted process that fails to load, dies
    or misses its startup deadline is reported by ``poll`` as a ``WorkerFailed``.
    """

    def __init__(self, config_data: dict[str, Any], num_ranks: int, protocol_name: str,
                 frontend_transport, startup_timeout: float = 600.0):
        self.ctx = zmq.Context.instance()
        self.config_data = config_data
        self.num_ranks = num_ranks
        self.protocol_name = protocol_name
        self.frontend = frontend_transport
        self.startup_timeout = startup_timeout
        self.ranks: dict[int, _Process] = {}
        self.addresses: dict[int, str] = {num_ranks: frontend_transport.address}  # the frontend is rank N
        self.ready_gauges: dict[int, dict[str, float]] = {}
        self._closed = False
        try:
            for rank in range(num_ranks):
                self.ranks[rank] = self._spawn(rank)
            while not all(p.ready for p in self.ranks.values()):
                for event in self._receive(0.5):
                    if isinstance(event, WorkerFailed):
                        raise RuntimeError(f"worker rank {event.rank} failed to start: {event.error}")
        except BaseException:
            self.close()
            raise
        self._publish_peers()

    # ------------------------------------------------------------ the runtime's calls
    def send(self, rank: int, plan: StepPlan) -> None:
        """Queue the plan for the rank. Never blocks on a dead worker: a bound PUSH socket
        whose only peer is gone would wait forever; the plan is dropped instead and the
        next ``poll`` reports the death."""
        process = self.ranks[rank]
        if process.failed or not process.ready:
            return
        data = protocol.encode(plan)
        while True:
            try:
                process.plans.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if not process.proc.is_alive():
                    return
                process.plans.poll(100, zmq.POLLOUT)

    def poll(self, timeout: float) -> list[Event]:
        """Step results and failures (each death reported once, per process)."""
        return [e for e in self._receive(timeout) if isinstance(e, (StepResult, WorkerFailed))]

    def restart(self, rank: int, on_ready: Callable[[int, dict[str, float]], None]) -> None:
        """Start a new process for ``rank`` (whose process failed); see the class doc."""
        old = self.ranks[rank]
        self._stop(old)
        log.warning("restarting worker rank %d (the old process %s, pid %s, is gone)", rank, old.proc.name,
                    old.proc.pid)
        self.ready_gauges.pop(rank, None)
        self.ranks[rank] = self._spawn(rank, on_ready)

    def stats(self) -> dict[int, dict[str, float]]:
        return {rank: dict(gauges) for rank, gauges in self.ready_gauges.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for process in self.ranks.values():
            if process.proc.is_alive():
                try:
                    process.plans.send(protocol.encode(Shutdown("server stopping")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for process in self.ranks.values():
            self._stop(process, grace_s=5.0)

    # ------------------------------------------------------------------- internals
    def _spawn(self, rank: int, on_ready=None) -> _Process:
        plans, results = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        plan_port = plans.bind_to_random_port("tcp://127.0.0.1")
        result_port = results.bind_to_random_port("tcp://127.0.0.1")
        proc = mp.get_context("spawn").Process(
            target=worker_main, name=f"mstar-worker-{rank}", daemon=True,
            args=(self.config_data, rank, self.num_ranks, self.protocol_name,
                  f"tcp://127.0.0.1:{plan_port}", f"tcp://127.0.0.1:{result_port}"))
        proc.start()
        return _Process(proc, plans, results, time.monotonic() + self.startup_timeout, on_ready=on_ready)

    def _stop(self, process: _Process, grace_s: float = 0.0) -> None:
        """Make sure the process is gone (joined, killed past ``grace_s``) and close its sockets."""
        process.failed = True
        process.proc.join(timeout=grace_s)
        if process.proc.is_alive():
            process.proc.kill()
            process.proc.join(timeout=5)
        for sock in (process.plans, process.results):
            sock.close(linger=0)

    def _receive(self, timeout: float) -> list[Event | WorkerReady]:
        """Every message from the live processes (waiting up to ``timeout`` for the first),
        then a ``WorkerFailed`` for each process found dead or late since the last call."""
        live = {p.results: rank for rank, p in self.ranks.items() if not p.failed}
        out: list[Event | WorkerReady] = []
        poller = zmq.Poller()
        for sock in live:
            poller.register(sock, zmq.POLLIN)
        if live:
            readable = [sock for sock, _ in poller.poll(int(timeout * 1000))]
        else:  # every rank is down: nothing to wait for but the caller's timeout
            readable = []
            time.sleep(timeout)
        for sock in readable:
            while True:
                try:
                    msg = protocol.decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                out.append(msg)
                if isinstance(msg, WorkerReady):
                    self._ready(live[sock], msg)
                elif isinstance(msg, WorkerFailed):
                    self.ranks[live[sock]].failed = True
        for rank, process in self.ranks.items():
            if process.failed:
                continue
            if not process.proc.is_alive():
                process.failed = True
                when = "" if process.ready else " while loading"
                out.append(WorkerFailed(rank, f"worker process {process.proc.name} (pid {process.proc.pid}) "
                                              f"{_exit_description(process.proc.exitcode)}{when}"))
            elif not process.ready and time.monotonic() > process.deadline:
                process.failed = True
                process.proc.kill()
                out.append(WorkerFailed(rank, f"worker process {process.proc.name} (pid {process.proc.pid}) "
                                              f"did not load within {self.startup_timeout:.0f} s"))
        return out

    def _ready(self, rank: int, msg: WorkerReady) -> None:
        process = self.ranks[rank]
        process.ready = True
        self.addresses[rank] = msg.tensor_address
        self.ready_gauges[rank] = dict(msg.gauges)
        log.info("worker rank %d is ready", rank)
        if process.on_ready is not None:  # a restart: tell everyone where the rank lives now
            self._publish_peers()
            process.on_ready(rank, dict(msg.gauges))

    def _publish_peers(self) -> None:
        """Send the peer table to every ready rank, and connect the frontend to the ranks."""
        table = protocol.encode(PeerTable(dict(self.addresses)))
        for process in self.ranks.values():
            if process.ready and not process.failed:
                try:
                    process.plans.send(table, zmq.NOBLOCK)
                except zmq.Again:  # it died since: the next poll reports that
                    pass
        self.frontend.connect({r: a for r, a in self.addresses.items() if r != self.num_ranks})


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def worker_main(config_data: dict[str, Any], rank: int, frontend_rank: int, protocol_name: str,
                plan_addr: str, result_addr: str) -> None:
    """Entry point of a worker process."""
    num_ranks = frontend_rank  # ranks are 0..N-1 and the frontend is N
    logging.basicConfig(level=os.environ.get("MSTAR_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    # Share the cores between the ranks of this host: oversubscribed BLAS threads thrash.
    fair_share = max(1, (os.cpu_count() or 1) // num_ranks)
    torch.set_num_threads(max(1, int(os.environ.get("MSTAR_WORKER_THREADS", fair_share))))
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.connect(plan_addr)
    results = ctx.socket(zmq.PUSH)
    results.connect(result_addr)
    transport = make_transport(protocol_name, rank)
    try:
        worker = build_worker(config_data, rank, transport, frontend_rank)
    except Exception as err:
        log.exception("worker %d failed to load", rank)
        results.send(protocol.encode(WorkerFailed(rank, f"{type(err).__name__}: {err}")))
        time.sleep(0.5)
        return
    results.send(protocol.encode(WorkerReady(rank, transport.address, worker.stats())))
    server = os.getppid()
    while True:
        if not plans.poll(PARENT_CHECK_MS):
            if os.getppid() != server:  # the server died without stopping us: do not linger
                log.error("worker %d: the server process %d is gone; exiting", rank, server)
                break
            continue
        msg = protocol.decode(plans.recv())
        if isinstance(msg, PeerTable):
            transport.connect({r: a for r, a in msg.addresses.items() if r != rank})
        elif isinstance(msg, StepPlan):
            try:
                results.send(protocol.encode(worker.execute(msg)))
            except Exception as err:
                log.error("worker %d crashed:\n%s", rank, traceback.format_exc())
                results.send(protocol.encode(WorkerFailed(rank, f"{type(err).__name__}: {err}")))
                break
        elif isinstance(msg, Shutdown):
            break
    transport.close()
    results.close(linger=1000)
    plans.close(linger=0)
    ctx.term()
