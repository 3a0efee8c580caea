"""The worker side of the runtime: worker ranks in this process, or one process per rank.

Both pools present the same calls to the runtime loop: ``send(rank, plan)``,
``poll(timeout)`` for step results and failures, ``stats()`` (each rank's engine gauges
before any work; later ones ride on every ``StepResult``) and ``close()``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
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


class ProcessWorkers:
    """One spawned process per rank, driven over ZeroMQ (plans down, results up)."""

    def __init__(self, config_data: dict[str, Any], num_ranks: int, protocol_name: str,
                 frontend_transport, startup_timeout: float = 600.0):
        self.ctx = zmq.Context.instance()
        self.results = self.ctx.socket(zmq.PULL)
        port = self.results.bind_to_random_port("tcp://127.0.0.1")
        result_addr = f"tcp://127.0.0.1:{port}"
        spawn = mp.get_context("spawn")
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.plans: dict[int, zmq.Socket] = {}
        self.failed: set[int] = set()
        self.ready_gauges: dict[int, dict[str, float]] = {}
        frontend_rank = num_ranks
        for rank in range(num_ranks):
            sock = self.ctx.socket(zmq.PUSH)
            plan_port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.plans[rank] = sock
            proc = spawn.Process(target=worker_main, name=f"mstar-worker-{rank}", daemon=True,
                                 args=(config_data, rank, frontend_rank, protocol_name,
                                       f"tcp://127.0.0.1:{plan_port}", result_addr))
            proc.start()
            self.procs[rank] = proc
        addresses = {frontend_rank: frontend_transport.address}
        deadline = time.monotonic() + startup_timeout
        while len(addresses) <= num_ranks:
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("workers did not start in time")
            dead = [r for r, p in self.procs.items() if not p.is_alive()]
            if dead:
                self.close()
                raise RuntimeError(f"worker rank {dead[0]} exited during startup (see its log above)")
            if self.results.poll(500):
                msg = protocol.decode(self.results.recv())
                if isinstance(msg, WorkerFailed):
                    self.close()
                    raise RuntimeError(f"worker rank {msg.rank} failed to start: {msg.error}")
                if isinstance(msg, WorkerReady):
                    addresses[msg.rank] = msg.tensor_address
                    self.ready_gauges[msg.rank] = dict(msg.gauges)
                    log.info("worker rank %d is ready", msg.rank)
        table = protocol.encode(PeerTable(addresses))
        for sock in self.plans.values():
            sock.send(table)
        frontend_transport.connect({r: a for r, a in addresses.items() if r != frontend_rank})

    def send(self, rank: int, plan: StepPlan) -> None:
        """Queue the plan for the rank. Never blocks on a dead worker: a bound PUSH socket
        whose only peer is gone would wait forever; the plan is dropped instead and the
        next ``poll`` reports the death."""
        data = protocol.encode(plan)
        sock = self.plans[rank]
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if not self.procs[rank].is_alive():
                    return
                sock.poll(100, zmq.POLLOUT)

    def poll(self, timeout: float) -> list[Event]:
        out: list[Event] = []
        if self.results.poll(int(timeout * 1000)):
            while True:
                try:
                    msg = protocol.decode(self.results.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, (StepResult, WorkerFailed)):
                    out.append(msg)
        for rank, proc in self.procs.items():
            if rank not in self.failed and not proc.is_alive():
                self.failed.add(rank)
                out.append(WorkerFailed(rank, f"worker process {proc.name} (pid {proc.pid}) "
                                              f"{_exit_description(proc.exitcode)}"))
        return out

    def stats(self) -> dict[int, dict[str, float]]:
        return {rank: dict(gauges) for rank, gauges in self.ready_gauges.items()}

    def close(self) -> None:
        for rank, sock in self.plans.items():
            try:
                sock.send(protocol.encode(Shutdown("server stopping")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for sock in [*self.plans.values(), self.results]:
            sock.close(linger=0)


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def worker_main(config_data: dict[str, Any], rank: int, frontend_rank: int, protocol_name: str,
                plan_addr: str, result_addr: str) -> None:
    num_ranks = frontend_rank  # ranks are 0..N-1 and the frontend is N
    """Entry point of a worker process."""
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
