"""The worker side of the runtime: worker ranks in this process, or one process per rank.

Both pools present the same calls to the runtime loop: ``send(rank, plan)``,
``poll(timeout)`` for step results and failures, ``wake()`` (from any thread: the
``poll`` waiting now, or the next one, returns at once), ``stats()`` (each rank's engine
gauges before any work; later ones ride on every ``StepResult``) and ``close()``. The
process pool can also ``restart`` a rank whose process died.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import zmq

from mstar.distributed import SINGLE, use_parallel
from mstar.runtime import protocol
from mstar.runtime.heartbeat import HeartbeatSender
from mstar.runtime.lockstep import (
    Follower,
    LeaderEngine,
    World,
    join_world,
    stop_followers,
)
from mstar.runtime.protocol import (
    Heartbeat,
    PeerTable,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from mstar.runtime.transport import make_transport
from mstar.runtime.transport.shm import remove_leftovers
from mstar.runtime.worker import Worker

log = logging.getLogger(__name__)

Event = StepResult | WorkerFailed
_WAKE = object()  # put into an in-process pool's result queue by ``wake``

PARENT_CHECK_MS = 1000  # how often an idle worker process checks that its server still lives
DIST_TIMEOUT = timedelta(seconds=300)  # joining the split groups' process groups; their collectives


def freeze_startup_objects() -> None:
    """Collect once, then exempt everything alive from later garbage collections
    (``gc.freeze``): the loaded model's modules, the tokenizer and the libraries are objects
    that live as long as the process, and every full collection walks them all, stopping
    every thread of the process (the conductor, the event loop, a worker's step) meanwhile.
    On a 2-core machine a full collection of a loaded server took 80-190 ms. Called once a
    process has loaded, before it serves (as vLLM does after start-up)."""
    gc.collect()
    gc.freeze()


def build_worker(config_data: dict[str, Any], rank: int, transport, frontend_rank: int,
                 rendezvous: str | None = None) -> Worker | Follower:
    """Load the model parts placed on ``rank`` and wrap them in a Worker, or in a Follower
    when the rank follows the leader of a split group.

    With split groups (``tp_size x sp_size > 1``) every process first joins their process
    groups at ``rendezvous`` (a ``torch.distributed`` URL); each group's engines are built
    under its parallel state, and a leader's engines hand every call to its followers.
    """
    from mstar.config import parse_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    config = parse_config(config_data)
    spec = model_class(config.model)(config)
    graph = spec.graph()
    placement = build_placement(graph, config)
    device = config.device_of(rank)
    split = placement.split_groups()
    if split and rendezvous is None:
        raise RuntimeError("a deployment with split node groups needs a rendezvous for its worker processes")
    world = join_world(rank, [g.layout for g in split], rendezvous, device, DIST_TIMEOUT) if split else World({})
    by_layout: dict[Any, set[str]] = {}  # layout of a split group (None: this rank alone) -> nodes
    for group, nodes in placement.groups_on(rank).items():
        by_layout.setdefault(group.layout if group.is_split else None, set()).update(nodes)
    engines = {}
    for layout, nodes in by_layout.items():
        with use_parallel(world.states[layout] if layout else SINGLE):
            engines |= spec.build_engines(nodes, device)
    if world.follows:
        assert world.channel is not None
        return Follower(rank, world.channel, engines)
    if world.leads:
        assert world.channel is not None
        led = {node for layout, nodes in by_layout.items() if layout and layout[0][0] == rank for node in nodes}
        engines = {node: LeaderEngine(node, e, world.channel) if node in led else e for node, e in engines.items()}
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
        out: list[Any] = []
        try:
            out.append(self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            return [event for event in out if event is not _WAKE]

    def wake(self) -> None:
        self._results.put(_WAKE)

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
    heard: float | None = None  # when its latest heartbeat (or its WorkerReady) came


class ProcessWorkers:
    """One spawned process per rank, driven over ZeroMQ (plans down, results up).

    ``restart(rank, on_ready)`` replaces a dead rank's process without blocking: the new
    one loads its engines while the others keep working; once it reports ready, every rank
    and the frontend transport get the new peer table and ``on_ready(rank, gauges)`` runs
    (inside ``poll``, on the caller's thread). A restarted process that fails to load, dies
    or misses its startup deadline is reported by ``poll`` as a ``WorkerFailed``.

    ``split_groups`` (``Placement.split_groups()``) are node groups run over several ranks:
    their ranks, the *world*, join one ``torch.distributed`` rendezvous and fail and restart
    together (a process group cannot take a new member). A death in the world stops all of
    it and is reported for each rank that gets plans (followers are invisible to the
    runtime); restarting any of those ranks restarts the whole world at a new rendezvous.
    """

    control_host = "127.0.0.1"  # where the plan and result sockets listen (the workers are local)
    # A ready rank silent this long is lost (its workers send heartbeats: ``heartbeat.py``);
    # None: a local process's death is seen from its handle, no heartbeats needed.
    lost_after_s: float | None = None

    def __init__(self, config_data: dict[str, Any], num_ranks: int, protocol_name: str,
                 frontend_transport, startup_timeout: float = 600.0, split_groups: Sequence = ()):
        self.ctx = zmq.Context.instance()
        self.config_data = config_data
        self.num_ranks = num_ranks
        self.protocol_name = protocol_name
        self.frontend = frontend_transport
        self.startup_timeout = startup_timeout
        self.ranks: dict[int, _Process] = {}
        self.addresses: dict[int, str] = {num_ranks: frontend_transport.address}  # the frontend is rank N
        self.ready_gauges: dict[int, dict[str, float]] = {}
        self.world = frozenset(r for g in split_groups for r in g.ranks)
        self.followers = frozenset(r for g in split_groups for r in g.ranks[1:])
        self._world_down = False  # the world failed and is not respawned yet
        self._rendezvous_dir = tempfile.mkdtemp(prefix="mstar-rendezvous-") if self.world else None
        self._generation = 0
        self._closed = False
        # ``wake``: any thread pushes an empty message that ``_receive`` polls beside the results.
        address = f"inproc://mstar-wake-{id(self)}"
        self._woken = self.ctx.socket(zmq.PULL)
        self._woken.bind(address)
        self._waker = self.ctx.socket(zmq.PUSH)
        self._waker.connect(address)
        self._wake_lock = threading.Lock()  # a zmq socket is not thread-safe
        try:
            rendezvous = self._rendezvous()
            for rank in range(num_ranks):
                self.ranks[rank] = self._spawn(rank, rendezvous=rendezvous if rank in self.world else None)
            while not all(p.ready for p in self.ranks.values()):
                for event in self._receive(0.5):
                    if isinstance(event, WorkerFailed):
                        raise RuntimeError(f"worker rank {event.rank} failed to start: {event.error}")
        except BaseException:
            self.close()
            raise
        # The workers ignore SIGTERM (see worker_main), which is all multiprocessing's exit
        # handler sends its daemons before joining them: stop them here if no one else did.
        atexit.register(self.close)
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

    def wake(self) -> None:
        with self._wake_lock:
            if not self._waker.closed:
                try:
                    self._waker.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wakes already queued: the next poll returns at once anyway
                    pass

    def restart(self, rank: int, on_ready: Callable[[int, dict[str, float]], None]) -> None:
        """Start a new process for ``rank`` (whose process failed); see the class doc."""
        if rank in self.world:
            if self._world_down:  # the first restart asked for since the world failed: all of it
                self._world_down = False
                rendezvous = self._rendezvous()
                log.warning("restarting the worker ranks of the split node groups %s", sorted(self.world))
                for member in sorted(self.world):
                    self._replace(member, None, rendezvous)
            self.ranks[rank].on_ready = on_ready  # another member's restart may have spawned it
            return
        self._replace(rank, on_ready, None)

    def stats(self) -> dict[int, dict[str, float]]:
        """The gauges of the ranks that get plans (a follower mirrors its leader)."""
        return {rank: dict(gauges) for rank, gauges in self.ready_gauges.items() if rank not in self.followers}

    def close(self) -> None:
        """Stop every worker: a ready one finishes its step and exits (killed past 5 s), one
        still loading is killed at once (it has nothing to finish)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for process in self.ranks.values():
            if process.proc.is_alive():
                try:
                    process.plans.send(protocol.encode(Shutdown("server stopping")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for process in self.ranks.values():
            self._stop(process, grace_s=5.0 if process.ready else 0.0)
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
        with self._wake_lock:
            self._waker.close(linger=0)
            self._woken.close(linger=0)

    # ------------------------------------------------------------------- internals
    def _rendezvous(self) -> str | None:
        """A fresh rendezvous for the world's processes (a new one per restart of it)."""
        if self._rendezvous_dir is None:
            return None
        self._generation += 1
        return f"file://{os.path.join(self._rendezvous_dir, f'rendezvous-{self._generation}')}"

    def _replace(self, rank: int, on_ready, rendezvous: str | None) -> None:
        old = self.ranks[rank]
        self._stop(old)
        log.warning("restarting worker rank %d (the old process %s, pid %s, is gone)", rank, old.proc.name,
                    old.proc.pid)
        self.ready_gauges.pop(rank, None)
        self.ranks[rank] = self._spawn(rank, on_ready, rendezvous)

    def _spawn(self, rank: int, on_ready=None, rendezvous: str | None = None) -> _Process:
        plans, results = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        host = self.control_host
        plan_port = plans.bind_to_random_port(f"tcp://{host}")
        result_port = results.bind_to_random_port(f"tcp://{host}")
        proc = self._start(rank, f"tcp://{host}:{plan_port}", f"tcp://{host}:{result_port}", rendezvous)
        return _Process(proc, plans, results, time.monotonic() + self.startup_timeout, on_ready=on_ready)

    def _start(self, rank: int, plan_addr: str, result_addr: str, rendezvous: str | None):
        """Start the rank's worker, connecting to the two control addresses; return its
        handle (``is_alive``, ``join``, ``kill``, ``name``, ``pid``: a process's calls)."""
        proc = mp.get_context("spawn").Process(
            target=worker_main, name=f"mstar-worker-{rank}", daemon=True,
            args=(self.config_data, rank, self.num_ranks, self.protocol_name, plan_addr, result_addr, rendezvous))
        proc.start()
        return proc

    def _gone(self, process: _Process) -> str:
        """How a dead worker went, for its ``WorkerFailed``."""
        return (f"worker process {process.proc.name} (pid {process.proc.pid}) "
                f"{_exit_description(process.proc.exitcode)}")

    def _late(self, process: _Process) -> str:
        return f"worker process {process.proc.name} (pid {process.proc.pid}) did not load"

    def _silent(self, process: _Process, now: float) -> bool:
        """A ready rank that has sent no heartbeat for ``lost_after_s``.
        (A loading rank is not judged by it: a load may hold the GIL in one long call;
        its startup deadline covers it.)"""
        return (self.lost_after_s is not None and process.ready and process.heard is not None
                and now - process.heard > self.lost_after_s)

    def _lost(self, process: _Process, silence: float) -> str:
        """Why a silent rank is declared lost, for its ``WorkerFailed``."""
        return f"worker process {process.proc.name} (pid {process.proc.pid}) sent no heartbeat for {silence:.1f} s"

    def _stop(self, process: _Process, grace_s: float = 0.0) -> None:
        """Make sure the process is gone (joined, killed past ``grace_s``) and close its sockets."""
        process.failed = True
        process.proc.join(timeout=grace_s)
        if process.proc.is_alive():
            process.proc.kill()
            process.proc.join(timeout=5)
        proc = process.proc
        if isinstance(proc, BaseProcess) and not proc.is_alive() and proc.exitcode != 0:
            remove_leftovers(proc.pid)  # a local process that did not exit cleanly left them behind
        for sock in (process.plans, process.results):
            sock.close(linger=0)

    def _receive(self, timeout: float) -> list[Event | WorkerReady]:
        """Every message from the live processes (waiting up to ``timeout`` for the first),
        then a ``WorkerFailed`` for each process found dead or late since the last call."""
        live = {p.results: rank for rank, p in self.ranks.items() if not p.failed}
        out: list[Event | WorkerReady] = []
        poller = zmq.Poller()
        for sock in (*live, self._woken):
            poller.register(sock, zmq.POLLIN)
        readable = [sock for sock, _ in poller.poll(int(timeout * 1000))]
        if self._woken in readable:
            readable.remove(self._woken)
            while True:
                try:
                    self._woken.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        now = time.monotonic()
        for sock in readable:
            while True:
                try:
                    msg = protocol.decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, (Heartbeat, WorkerReady)):
                    # Only these count: an actor whose raylet died may still send results,
                    # but it stopped beating, and Ray can neither restart nor stop it.
                    self.ranks[live[sock]].heard = now
                if isinstance(msg, Heartbeat):
                    continue
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
                out.append(WorkerFailed(rank, f"{self._gone(process)}{when}"))
            elif self._silent(process, now):
                process.failed = True
                out.append(WorkerFailed(rank, self._lost(process, now - process.heard)))
            elif not process.ready and time.monotonic() > process.deadline:
                process.failed = True
                process.proc.kill()
                out.append(WorkerFailed(rank, f"{self._late(process)} within {self.startup_timeout:.0f} s"))
        return self._fail_world_together(out)

    def _fail_world_together(self, events: list[Event | WorkerReady]) -> list[Event | WorkerReady]:
        """A failure in the world stops all of it; it is reported once, for each of its
        ranks that gets plans (a follower's death fails its leader's requests)."""
        out: list[Event | WorkerReady] = []
        for event in events:
            if not isinstance(event, WorkerFailed) or event.rank not in self.world:
                out.append(event)
                continue
            if self._world_down:
                continue
            self._world_down = True
            for member in self.world:
                self._stop(self.ranks[member])
            for member in sorted(self.world - self.followers):
                why = event.error if member == event.rank else \
                    f"rank {event.rank} of its split node group failed: {event.error}"
                out.append(WorkerFailed(member, why))
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


def worker_threads(config_data: dict[str, Any], num_ranks: int) -> int:
    """Intra-op threads of a worker process on this host. The ranks of one model run at once
    (a pipeline, a split group), so they share the cores: oversubscribed BLAS threads thrash.
    The parts of a many-model deployment take turns (a voice agent hears, then thinks, then
    speaks), so each of its workers gets every core: on 2 cores a third each made the voice
    agent's reply start 0.98 s after the user's turn instead of 0.52 s.

    Local ``replicas`` serve at once, so they split the cores too: two SmolLM2 replicas of a
    thread per core each on 2 cores, two busy processes beside them, took 42 s for a test's 32
    requests against 8 s with a thread each."""
    from mstar.model.composite import ComposedSpec
    from mstar.model.registry import model_class

    cores = max(1, (os.cpu_count() or 1) // config_data.get("replicas", 1))
    return cores if issubclass(model_class(config_data["model"]), ComposedSpec) else max(1, cores // num_ranks)


def worker_main(config_data: dict[str, Any], rank: int, frontend_rank: int, protocol_name: str,
                plan_addr: str, result_addr: str, rendezvous: str | None = None) -> None:
    """Entry point of a worker process.

    It ignores SIGINT and SIGTERM: a Ctrl-C in a terminal, or a process manager stopping
    the server, signals the whole process group, and a worker that died of it would be
    reported (and restarted) while the server drains the requests still running on it. The
    server stops its workers itself once they are done (``Shutdown``); a worker whose server
    is gone exits on its own (see ``_serve``), and one the server forgot to stop is stopped
    when the server exits (``ProcessWorkers`` closes itself then). Before this function runs
    (while the new process imports torch) the signal still ends it; the server stops too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    num_ranks = frontend_rank  # ranks are 0..N-1 and the frontend is N
    logging.basicConfig(level=os.environ.get("MSTAR_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("MSTAR_WORKER_THREADS", worker_threads(config_data, num_ranks)))))
    server = os.getppid()
    run_worker(config_data, rank, frontend_rank, protocol_name, plan_addr, result_addr, rendezvous,
               server_alive=lambda: os.getppid() == server)


def run_worker(config_data: dict[str, Any], rank: int, frontend_rank: int, protocol_name: str,
               plan_addr: str, result_addr: str, rendezvous: str | None = None, *,
               host: str = "127.0.0.1", node: str | None = None,
               server_alive: Callable[[], bool] = lambda: True, heartbeat_s: float | None = None) -> None:
    """A worker's life wherever it runs (a local process, a Ray actor): load the rank's
    engines, report ready with its tensor address (TCP bound on ``host``; ``node``: the
    machine's name, for ``shm+tcp``), then serve plans until the server says stop, or
    ``server_alive()`` turns false while idle. With ``heartbeat_s`` a thread tells the
    server every ``heartbeat_s`` that the rank is there, while ``server_alive()`` holds."""
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.connect(plan_addr)
    results = ctx.socket(zmq.PUSH)
    results.connect(result_addr)
    heartbeat = None if heartbeat_s is None else \
        HeartbeatSender(ctx, result_addr, rank, period_s=heartbeat_s, attached=server_alive)
    transport = make_transport(protocol_name, rank, host=host, node=node)
    try:
        worker = build_worker(config_data, rank, transport, frontend_rank, rendezvous)
    except Exception as err:
        log.exception("worker %d failed to load", rank)
        results.send(protocol.encode(WorkerFailed(rank, f"{type(err).__name__}: {err}")))
        time.sleep(0.5)
        if heartbeat is not None:
            heartbeat.close()
        return
    freeze_startup_objects()
    results.send(protocol.encode(WorkerReady(rank, transport.address, worker.stats())))
    if isinstance(worker, Follower):
        _follow(worker)
    else:
        _serve(worker, rank, plans, results, transport, server_alive)
    if heartbeat is not None:
        heartbeat.close()
    transport.close()
    results.close(linger=1000)
    plans.close(linger=0)
    ctx.term()


def _follow(follower: Follower) -> None:
    """A follower's life: its leader's calls until it says stop (or its process is gone)."""
    try:
        follower.run()
    except Exception as err:
        log.error("worker %d: lost its leader (%s); exiting", follower.rank, err)
        raise SystemExit(1) from None


def _serve(worker: Worker, rank: int, plans: zmq.Socket, results: zmq.Socket, transport,
           server_alive: Callable[[], bool]) -> None:
    """A worker's loop: plans in, results out, until the server says stop or is gone."""
    while True:
        if not plans.poll(PARENT_CHECK_MS):
            if not server_alive():  # the server died without stopping us: do not linger
                log.error("worker %d: the server is gone; exiting", rank)
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
            try:  # on a crash or a lost server, followers see this process go instead
                stop_followers(worker.engines)
            except RuntimeError as err:
                log.info("worker %d: its followers are gone already (%s)", rank, err)
            break
