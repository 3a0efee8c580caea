"""The runtime: the conductor's loop and the frontend's receiving end, in the API server.

Two threads. The *loop* thread owns the conductor: it takes submissions and cancellations,
sends plans to the workers and feeds their results back. The *emit* thread receives the
tensors workers emit straight to the frontend and turns them into client events. Neither
runs torch models: the workers do.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mstar.contract import OutputEvent, RequestError, SessionSpec
from mstar.model.spec import OutputStream, WalkRequest
from mstar.runtime.admission import AdmissionGate
from mstar.runtime.conductor import AdmissionError, Conductor, Finished, Progress, RequestSpec
from mstar.runtime.placement import Placement, Routes
from mstar.runtime.protocol import (
    SessionRef,
    StepResult,
    WorkerFailed,
    abandon_key,
    parse_emit_batch,
    tensor_key,
    unpack_values,
)
from mstar.runtime.sessions import SessionBook
from mstar.runtime.worker import RELEASED_REMEMBERED

log = logging.getLogger(__name__)

PROGRESS_LOG_S = 10.0  # a long request's progress is logged at most this often (and at its first and last step)

Sink = Callable[[OutputEvent | None], None]  # receives events; None closes the stream


@dataclass
class _Tracked:
    """The frontend's view of one request while it streams."""

    stream: OutputStream
    sink: Sink
    prompt_tokens: int
    client_id: str = ""  # the id the caller gave (the runtime's may carry a suffix)
    received: int = 0
    expected: int | None = None  # known once the conductor says it finished
    finished: Finished | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Emits reach the frontend straight from the workers, so two ranks' (a prefill rank's
    # first token, the decode rank's next ones) may arrive out of order: each output is
    # delivered in the order its step was dispatched. ``order``: the versions of the
    # outputs still to come, in dispatch order; ``held``: arrived early, by version;
    # ``steps``: step name -> {emitting port: version} of the steps in flight (read and
    # written on the conductor thread only, so it may be asked without the lock).
    order: list[int] = field(default_factory=list)
    held: dict[int, tuple[str, object]] = field(default_factory=dict)
    steps: dict[str, dict[str, int]] = field(default_factory=dict)
    delivering: threading.Lock = field(default_factory=threading.Lock)  # one thread delivers at a time
    progress_logged: float = 0.0  # when its progress was last logged (monotonic)
    session: SessionSpec | None = None  # the session it runs in, finished in the book when it closes
    # Client streams (``ClientStream``): items appended so far per stream (first-dim length),
    # each stream's cap, the next (negative) version, and whether the input has ended.
    stream_items: dict[str, int] = field(default_factory=dict)
    stream_limits: dict[str, int | None] = field(default_factory=dict)
    stream_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # an item's trailing dims
    walk: str = ""
    next_append: int = -1
    input_ended: bool = False


class Runtime:
    """``max_queue_size``: how many requests may wait for admission before ``submit``
    refuses more (``Overloaded``); None: no limit. ``sessions``: the book of the
    deployment's sessions (default: 16 idle sessions kept, timeouts capped at an hour)."""

    def __init__(self, conductor: Conductor, placement: Placement, workers, frontend_transport,
                 *, log_stats: bool = False, max_queue_size: int | None = None,
                 sessions: SessionBook | None = None):
        self.conductor = conductor
        self.sessions = sessions or SessionBook(16, 3600.0)
        self.admission = AdmissionGate(conductor, max_queue_size)
        self.log_stats = log_stats
        self.placement = placement
        # a split group's leader -> every rank of the groups it leads (a session whose steps
        # run on the leader keeps state on each of them; a restart of any loses it)
        self._group_ranks: dict[int, frozenset[int]] = {}
        for group in placement.split_groups():
            self._group_ranks[group.ranks[0]] = self._group_ranks.get(group.ranks[0], frozenset()) | set(group.ranks)
        # a follower's session gauges ("node.sessions_held", "node.session_bytes"), as its leader
        # last reported them (followers send the frontend nothing themselves)
        self.follower_gauges: dict[int, dict[str, float]] = {}
        self.workers = workers
        self.transport = frontend_transport
        self.tracked: dict[str, _Tracked] = {}
        # Ticks in a row that changed nothing (no plan, no progress, no end) with no event or
        # command between them: live requests with every rank idle (a live call waiting for
        # its client's audio) wait for one instead of ticking in a spin.
        self._quiet_ticks = 0
        # The ids callers use -> the runtime's own. A worker drops inputs of ids it has released
        # (late arrivals), so an id used again gets a fresh runtime id while the workers may
        # still remember it; ``_ended`` holds as many ended caller ids as they remember.
        self._ids: dict[str, str] = {}
        self._ended_ids: OrderedDict[str, None] = OrderedDict()
        self._ids_lock = threading.Lock()
        self._incarnations = itertools.count(2)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.healthy = True
        self.failure: str | None = None
        # each rank's latest engine gauges ("node.stat" -> value), replaced on every result
        self.rank_gauges: dict[int, dict[str, float]] = dict(workers.stats())
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="mstar-conductor", daemon=True),
                         threading.Thread(target=self._receive_emits, name="mstar-emits", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ----------------------------------------------------------- client side
    def submit(self, request_id: str, request: WalkRequest, stream: OutputStream, sink: Sink,
               timeout_s: float | None = None, session: SessionSpec | None = None) -> None:
        """Queue the request. With ``session`` its steps run in that session: a busy one is
        refused (409), a resumed one the book does not know too (410), before anything queues."""
        if not self.healthy:
            raise RequestError("model", f"the server is unhealthy: {self.failure}", 503)
        client_id, request_id = request_id, self._runtime_id(request_id)
        try:
            self.admission.enter()  # raises Overloaded when the wait queue is full
        except BaseException:
            self._forget_id(client_id, ended=False)
            raise
        if session is not None:
            try:
                walk_routes = self.conductor.routes.get(request.walk)
                steps = frozenset(walk_routes.step_rank.values()) if walk_routes is not None else frozenset()
                ranks = steps.union(*(self._group_ranks.get(rank, ()) for rank in steps))
                stale = self.sessions.begin(session, ranks, time.monotonic())
            except BaseException:
                self._forget_id(client_id, ended=False)
                self.admission.withdraw()
                raise
            if stale:  # queued ahead of the submission: its plan drops them before its items run
                self.commands.put(("drop_sessions", stale))
        try:
            deadline = time.monotonic() + timeout_s if timeout_s else None
            ref = SessionRef(session.session_id, session.resume) if session is not None else None
            spec = RequestSpec(request_id, request.walk, request.params, request.cost, deadline, request.peak, ref)
            tracked = _Tracked(stream, sink, request.prompt_tokens, client_id, session=session, walk=request.walk)
            walk = self.conductor.graph.walk(request.walk)
            for client in walk.client_streams:
                limit = client.max_items
                tracked.stream_items[client.var] = 0
                tracked.stream_limits[client.var] = int(request.params[limit]) if isinstance(limit, str) else limit
            for var, values in request.appends.items():
                for value in values:
                    self._count_append(tracked, var, value)
            self.tracked[request_id] = tracked
            routes: Routes = self.conductor.routes[request.walk]
            later = []
            for var, value in request.inputs.items():
                if isinstance(value, Future):
                    later.append((var, value))
                    continue
                for rank in routes.destinations(var):
                    self.transport.send(rank, tensor_key(request_id, var, 0), {"value": value})
        except BaseException:
            self.tracked.pop(request_id, None)
            self._forget_id(client_id, ended=False)
            self.admission.withdraw()
            if session is not None:
                self._drop_sessions(self.sessions.finish(session.session_id, keep=False, now=time.monotonic()))
            raise
        self.commands.put(("submit", spec))
        for var, values in request.appends.items():
            for value in values:
                self._send_append(request_id, tracked, var, value)
        if request.end_input:
            self._end_input(request_id, tracked)
        self.workers.wake()
        # An input still being computed (a Future: seeded noise drawn on a background thread)
        # is sent on when it is ready; the steps reading it wait for it on their worker, the
        # others (the text encoder) run meanwhile.
        for var, value in later:
            value.add_done_callback(functools.partial(self._send_later, request_id, var, routes.destinations(var)))

    def _send_later(self, request_id: str, var: str, ranks, future: Future) -> None:
        try:
            value = future.result()
        except Exception as err:
            log.exception("input %r of %s failed", var, request_id)
            self.commands.put(("cancel", (request_id, "error", f"computing input {var!r} failed: {err}")))
            self.workers.wake()
            value = torch.empty(0)  # a step already waiting for it fails at once instead of timing out
        for rank in ranks:
            try:
                self.transport.send(rank, tensor_key(request_id, var, 0), {"value": value})
            except Exception:  # the runtime is closing
                log.warning("could not send input %r of %s to rank %d", var, request_id, rank)

    def append(self, request_id: str, var: str, value: torch.Tensor) -> None:
        """The client appends ``value`` (one item) to the request's client stream ``var``.
        An unknown stream, an append after ``end_input`` or past the stream's ``max_items``
        is refused (``RequestError``, 400); an ended request ignores it (it is closing)."""
        with self._ids_lock:
            request_id = self._ids.get(request_id, request_id)
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.closed:
            return
        with tracked.lock:
            self._count_append(tracked, var, value)
            self._send_append(request_id, tracked, var, value)
        self.workers.wake()

    def knows(self, client_id: str) -> bool:
        """Whether a request of that id was submitted and has not closed."""
        with self._ids_lock:
            own = self._ids.get(client_id)
        return own is not None and own in self.tracked

    def end_input(self, request_id: str) -> None:
        """The client's input ends: its client streams close once consumed."""
        with self._ids_lock:
            request_id = self._ids.get(request_id, request_id)
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.closed:
            return
        with tracked.lock:
            if tracked.input_ended:
                return
            self._end_input(request_id, tracked)
        self.workers.wake()

    def _end_input(self, request_id: str, tracked: _Tracked) -> None:
        """Every client stream gets a last, empty item, so its consumer runs once more with the
        chunk marked ``last`` (a front end flushes what it held back) even when every append
        was consumed already; the conductor closes the streams with it, in one command."""
        tracked.input_ended = True
        marks = []
        for var in tracked.stream_items:
            version, tracked.next_append = tracked.next_append, tracked.next_append - 1
            empty = torch.zeros((0, *tracked.stream_shapes.get(var, ())))
            for rank in self.conductor.routes[tracked.walk].destinations(var):
                self.transport.send(rank, tensor_key(request_id, var, version), {"value": empty})
            marks.append((var, version))
        self.commands.put(("end_input", (request_id, marks)))

    @staticmethod
    def _count_append(tracked: _Tracked, var: str, value: torch.Tensor) -> None:
        """Count an append against its stream's cap, before any node sees it."""
        if var not in tracked.stream_items:
            raise RequestError(var, f"the walk has no client stream {var!r}", 400)
        if tracked.input_ended:
            raise RequestError("end_input", "the input already ended: no more appends", 400)
        total = tracked.stream_items[var] + (int(value.shape[0]) if value.dim() else 1)
        limit = tracked.stream_limits[var]
        if limit is not None and total > limit:
            raise RequestError(var, f"{var} passes its limit of {limit} items ({total} appended)", 400)
        tracked.stream_items[var] = total
        tracked.stream_shapes[var] = tuple(value.shape[1:])

    def _send_append(self, request_id: str, tracked: _Tracked, var: str, value: torch.Tensor) -> None:
        version, tracked.next_append = tracked.next_append, tracked.next_append - 1
        for rank in self.conductor.routes[tracked.walk].destinations(var):
            self.transport.send(rank, tensor_key(request_id, var, version), {"value": value})
        self.commands.put(("append", (request_id, var, version)))

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self._ids_lock:
            request_id = self._ids.get(request_id, request_id)
        self.commands.put(("cancel", (request_id, reason)))
        self.workers.wake()

    def _runtime_id(self, client_id: str) -> str:
        """The runtime's id for a request the caller calls ``client_id``: the same, unless the
        caller used it before and the workers may still drop inputs under it. An id in use
        is refused (409 naming ``request_id``)."""
        with self._ids_lock:
            if client_id in self._ids:
                raise RequestError("request_id", f"request id {client_id!r} is already in use", 409)
            own = client_id
            while own in self._ended_ids or own in self.tracked:
                own = f"{client_id}#{next(self._incarnations)}"
            self._ids[client_id] = own
            return own

    def _forget_id(self, client_id: str, *, ended: bool = True) -> None:
        with self._ids_lock:
            own = self._ids.pop(client_id, None)
            if ended and own is not None:
                for key in {client_id, own}:
                    self._ended_ids[key] = None
                    self._ended_ids.move_to_end(key)
                while len(self._ended_ids) > RELEASED_REMEMBERED:
                    self._ended_ids.popitem(last=False)

    def end_session(self, session_id: str) -> None:
        """The client ends a session: its state is freed now, or once its request in flight ends."""
        self._drop_sessions(self.sessions.end(session_id))

    def _finish_session(self, session: SessionSpec, done: Finished | None, reason: str) -> None:
        """Its request ended: the session goes idle, or (ended by the client, or its request
        failed, was cancelled or timed out, so its state may be half-written) it is dropped."""
        keep = (done is not None and done.error is None and reason == done.reason
                and reason not in ("cancelled", "error", "timeout") and not session.end)
        self._drop_sessions(self.sessions.finish(session.session_id, keep=keep, now=time.monotonic()))

    def pin_session(self, session_id: str, pinned: bool = True) -> None:
        """Keep a session from eviction and expiry between its requests (a live socket's)."""
        self.sessions.pin(session_id, pinned)

    def _drop_sessions(self, session_ids: list[str]) -> None:
        if session_ids:
            self.commands.put(("drop_sessions", session_ids))
            self.workers.wake()

    def gauges(self) -> dict[str, float]:
        """Live values for /metrics: requests waiting and running, sessions kept (and busy),
        and every rank's engine gauges as ``rank<R>.<node>.<stat>`` (as of that rank's latest
        step; ``rank<R>.<node>.sessions_held``: the sessions whose state that node keeps there)."""
        out = {"requests_waiting": float(self.admission.waiting),
               "requests_running": float(self.conductor.num_live),
               "sessions_open": float(self.sessions.open),
               "sessions_busy": float(self.sessions.busy)}
        for rank, gauges in list(self.rank_gauges.items()) + list(self.follower_gauges.items()):
            out.update({f"rank{rank}.{name}": float(value) for name, value in gauges.items()})
        return out

    def close(self) -> None:
        self._stop.set()
        self.commands.put(("wake", None))
        self.workers.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.workers.close()
        self.transport.close()

    # ------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # Commands first: a cancel that came before a step's result is applied before it.
                self._drain_commands(block=self.conductor.idle and not self.conductor.busy)
                for event in self.workers.poll(self._poll_timeout()):
                    self._quiet_ticks = 0
                    if isinstance(event, StepResult):
                        if event.gauges:
                            self.rank_gauges[event.rank] = dict(event.gauges)
                        for rank, gauges in event.follower_gauges.items():
                            self.follower_gauges.setdefault(rank, {}).update(gauges)
                        # before its request can finish: each rank's own figure (a follower's too)
                        sizes = [(event.rank, event.session_bytes), *event.follower_session_bytes.items()]
                        for rank, by_session in sizes:
                            for session_id, nbytes in by_session.items():
                                self._drop_sessions(self.sessions.note_bytes(session_id, rank, nbytes))
                        self._settle_emits(event)
                        self.conductor.on_result(event)
                    elif isinstance(event, WorkerFailed):
                        self._rank_failed(event)
                # Whatever arrived while the poll waited (a step can take a while) goes into
                # this tick's plans, not the next one's; a submission also ends that wait.
                self._drain_commands(block=False)
                now = time.monotonic()
                expired = self.sessions.expire(now)
                if expired:
                    self.conductor.drop_sessions(expired)
                decisions = self.conductor.tick(now)
                acted = decisions.plans or decisions.progress or decisions.finished
                self._quiet_ticks = 0 if acted else self._quiet_ticks + 1
                for progress in decisions.progress:
                    self._report_progress(progress)
                for rank, plan in decisions.plans.items():
                    self._expect_emits(plan)
                    self.workers.send(rank, plan)
                for done in decisions.finished:
                    self._finished(done)
        except Exception as err:  # a bug in the conductor: fail everything loudly, never hang
            log.exception("conductor loop crashed")
            self.healthy = False
            self.failure = f"conductor crashed: {err}"
            for request_id in list(self.tracked):
                self._finished(Finished(request_id, "error", self.failure, 0))

    def _poll_timeout(self) -> float:
        """How long to wait for workers' events before the next tick (an event or a command
        ends the wait early): until a paced stream needs its next step when only such streams
        wait, not at all when work is ready, else 50 ms (the clock's work: session expiry)."""
        wait = self.conductor.pacing_wait
        if wait is not None:
            return min(0.05, max(0.001, wait))
        return 0.0 if self._has_ready_work() else 0.05

    def _has_ready_work(self) -> bool:
        """Whether the next tick should run at once. Live requests with every rank idle get
        ticks until two in a row change nothing (the second covers a tick whose changes only
        the next one turns into a plan); then they wait for an event, a command or 50 ms."""
        if self.conductor.has_work_for_idle_rank():
            return True
        return bool(self.conductor.live) and not self.conductor.busy and self._quiet_ticks < 2

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
            while True:
                kind, arg = command
                self._quiet_ticks = 0
                if kind == "submit":
                    try:
                        self.conductor.submit(arg)
                    except (AdmissionError, ValueError) as err:
                        self._finished(Finished(arg.request_id, "error", f"rejected: {err}", 0))
                    finally:
                        self.admission.handed_over()
                elif kind == "cancel":
                    self.conductor.cancel(*arg)  # (request_id, reason[, error])
                elif kind == "drop_sessions":
                    self.conductor.drop_sessions(arg)
                elif kind == "append":
                    self.conductor.append(*arg)  # (request_id, var, version)
                elif kind == "end_input":
                    self.conductor.end_input(*arg)  # (request_id, the streams' last items)
                command = self.commands.get_nowait()
        except queue.Empty:
            return

    def _rank_failed(self, event: WorkerFailed) -> None:
        log.error("worker rank %d failed: %s", event.rank, event.error)
        self.healthy = False
        self.failure = f"worker rank {event.rank} failed: {event.error}"
        self._abandon(event.rank, self.conductor.on_rank_failed(event.rank, event.error))
        if self._recovery is not None:
            self._recover(event.rank, event.error)

    def _abandon(self, rank: int, request_ids: list[str]) -> None:
        """Tell the other ranks that these requests failed with ``rank``: a step of theirs
        waiting for an input the dead rank would have sent gives up now (a 503 at once,
        rather than when the step's input timeout runs out)."""
        if not request_ids:
            return
        key = abandon_key(rank, request_ids)
        for other in self.rank_gauges:
            if other != rank:
                try:
                    self.transport.send(other, key, {})
                except Exception as err:  # not connected (yet): it has nothing of theirs to wait for
                    log.info("could not tell rank %d about the requests abandoned with rank %d: %s", other, rank, err)

    # -------------------------------------------------------- worker recovery
    _recovery: _Recovery | None = None  # None: a dead rank stays down, the server unhealthy

    def supervise(self, max_restarts: int, on_give_up: Callable[[str], None] | None = None, *,
                  outcome: str = "the server is shutting down") -> None:
        """Restart a rank whose worker process dies, at most ``max_restarts`` times per rank.
        Past that, when a restarted worker fails to load, or when the workers cannot be
        restarted at all, every request fails (503), the runtime stays unhealthy with no
        more restarts, and ``on_give_up(reason)`` runs on the conductor thread: it should
        make the server shut down, or (a replica) take the runtime out of rotation; it must
        not block. ``outcome`` ends the failure's text (what giving up leads to)."""
        self._recovery = _Recovery(max_restarts, on_give_up, outcome)

    def _recover(self, rank: int, error: str) -> None:
        recovery = self._recovery
        assert recovery is not None
        restart = getattr(self.workers, "restart", None)
        attempts = recovery.attempts.get(rank, 0)
        if recovery.gave_up:  # out for good: another rank's failure changes nothing
            return
        if rank in recovery.loading:
            self._give_up(rank, f"worker rank {rank} failed to load after a restart: {error}")
        elif restart is None:
            self._give_up(rank, f"worker rank {rank} failed and in-process workers cannot be restarted: {error}")
        elif attempts >= recovery.max_restarts:
            self._give_up(rank, f"worker rank {rank} failed and was restarted {attempts} time(s) already "
                          f"(--max-worker-restarts {recovery.max_restarts}): {error}")
        else:
            recovery.attempts[rank] = attempts + 1
            recovery.loading.add(rank)
            self.failure = (f"worker rank {rank} failed: {error}; restarting it "
                            f"(attempt {attempts + 1} of {recovery.max_restarts})")
            restart(rank, self._rank_restarted)

    def _rank_restarted(self, rank: int, gauges: dict[str, float]) -> None:
        """The restarted rank loaded its engines (called inside ``workers.poll``)."""
        recovery = self._recovery
        assert recovery is not None
        recovery.loading.discard(rank)
        self.rank_gauges[rank] = dict(gauges)
        self._abandon(rank, self.conductor.on_rank_restarted(rank))
        # its new process holds none of their state, nor do its followers' (restarted with it)
        lost = self.sessions.lost_rank(rank)
        for follower in self._group_ranks.get(rank, frozenset()) - {rank}:
            lost += self.sessions.lost_rank(follower)
            self.follower_gauges.pop(follower, None)
        if lost:
            self.conductor.drop_sessions(lost)
        log.warning("worker rank %d restarted", rank)
        if not self.conductor.failed_ranks and not recovery.gave_up:
            self.healthy, self.failure = True, None

    def _give_up(self, rank: int, reason: str) -> None:
        """No more restarts: fail every tracked request (503) and ask the server to stop."""
        recovery = self._recovery
        assert recovery is not None
        log.critical("giving up: %s", reason)
        recovery.gave_up = True
        self.healthy = False
        self.failure = f"{reason}; {recovery.outcome}"
        for request_id in list(self.tracked):
            self._finished(Finished(request_id, "error", self.failure, 0, failed_rank=rank))
        if recovery.on_give_up is not None:
            recovery.on_give_up(self.failure)

    def _finished(self, done: Finished) -> None:
        if self.log_stats:
            nodes = ", ".join(f"{node} {seconds * 1e3:.1f} ms" for node, seconds in sorted(done.profile.items()))
            log.info("request %s finished (%s): %s", done.request_id, done.reason, nodes or "no steps")
        tracked = self.tracked.get(done.request_id)
        if tracked is None:
            return
        with tracked.lock:
            tracked.finished = done
            tracked.expected = done.emitted
            ready = tracked.received >= done.emitted or done.error is not None
        if ready:
            self._close(done.request_id, tracked)

    def _expect_emits(self, plan) -> None:
        """Note, before the plan leaves, the versions its items will stream to the client."""
        for item in plan.items:
            tracked = self.tracked.get(item.request_id) if item.emit else None
            if tracked is None:
                continue
            versions = {port: item.writes[port].version for port in item.emit if port in item.writes}
            with tracked.lock:
                tracked.steps[item.step] = versions
                tracked.order.extend(sorted(versions.values()))

    def _settle_emits(self, result: StepResult) -> None:
        """A finished step's outputs that will never come (silent ports, a failed or
        preempted step) stop holding back the ones after them."""
        for item in result.results:
            tracked = self.tracked.get(item.request_id)
            if tracked is None or item.step not in tracked.steps:  # it emits nothing
                continue
            with tracked.lock:
                versions = tracked.steps.pop(item.step, {})
                if item.error is None and not item.preempted and not item.silent:
                    continue  # all it emits is on its way (most steps)
                gone = {v for port, v in versions.items()
                        if item.error is not None or item.preempted or port in item.silent}
                if gone:
                    tracked.order = [v for v in tracked.order if v not in gone]
            if gone:
                with tracked.delivering:
                    self._release_held(item.request_id, tracked)

    # ------------------------------------------------------------ emit thread
    def _receive_emits(self) -> None:
        while not self._stop.is_set():
            try:
                messages = self.transport.recv(timeout=0.5)
            except Exception:
                if self._stop.is_set():
                    return
                raise
            for key, tensors in messages:  # one message per plan: every output it streamed
                outputs = parse_emit_batch(key)
                values = unpack_values(tensors, len(outputs))
                for (request_id, version, modality), value in zip(outputs, values):
                    tracked = self.tracked.get(request_id)
                    if tracked is not None:
                        with tracked.delivering:
                            self._arrived(request_id, tracked, version, modality, value)

    def _arrived(self, request_id: str, tracked: _Tracked, version: int, modality: str, value) -> None:
        """Deliver an output now, or hold it while an output dispatched before it is on its way."""
        with tracked.lock:
            early = bool(tracked.order) and version in tracked.order and tracked.order[0] != version
            if early:
                tracked.held[version] = (modality, value)
            elif tracked.order and tracked.order[0] == version:
                tracked.order.pop(0)
        if not early:
            self._emit(request_id, tracked, modality, value)
            self._release_held(request_id, tracked)

    def _release_held(self, request_id: str, tracked: _Tracked) -> None:
        """Deliver the held outputs whose turn has come (the caller holds ``delivering``)."""
        while True:
            with tracked.lock:
                if not tracked.order or tracked.order[0] not in tracked.held:
                    return
                modality, value = tracked.held.pop(tracked.order.pop(0))
            self._emit(request_id, tracked, modality, value)

    def _emit(self, request_id: str, tracked: _Tracked, modality: str, value) -> None:
        """Turn an output into the client's event (the caller holds ``delivering``, so one
        thread feeds the stream at a time). The stream is fed outside ``tracked.lock``: the
        conductor thread takes that lock for every request of every plan (``_expect_emits``),
        and must not wait behind detokenising. ``received`` counts the output only once its
        event is out, so the request cannot be closed ahead of it."""
        if tracked.closed:
            return
        try:
            event = tracked.stream.feed(modality, value)
            media = tracked.stream.media_seconds
            if media:  # a media stream's clock, for streaming-aware scheduling
                self.conductor.note_media(request_id, media, time.monotonic())
        except Exception as err:
            log.exception("output processing failed for %s", request_id)
            event = OutputEvent(finish_reason="error", error=f"output processing failed: {err}")
        with tracked.lock:
            if tracked.closed:  # closed meanwhile (it failed): the event goes nowhere
                return
            if event is not None:
                event.prompt_tokens = tracked.prompt_tokens
                tracked.sink(event)
            tracked.received += 1
            stopped = tracked.stream.stopped or (event is not None and event.error is not None)
            complete = tracked.expected is not None and tracked.received >= tracked.expected
        if stopped:
            self.cancel(request_id, "stop")
            self._close(request_id, tracked, reason="stop" if event is None or event.error is None else "error")
        elif complete:
            self._close(request_id, tracked)

    def _report_progress(self, progress: Progress) -> None:
        """A Loop iteration that reports progress ended: the client gets a "progress" event
        (step k of n); the log gets a line at the first and last step and every
        ``PROGRESS_LOG_S`` between (the conductor thread; emits go their own way)."""
        tracked = self.tracked.get(progress.request_id)
        if tracked is None:
            return
        event = OutputEvent(modality="progress", progress=(progress.done, progress.total),
                            prompt_tokens=tracked.prompt_tokens)
        with tracked.lock:
            if tracked.closed:
                return
            tracked.sink(event)
        now = time.monotonic()
        if progress.done in (1, progress.total) or now - tracked.progress_logged >= PROGRESS_LOG_S:
            tracked.progress_logged = now
            log.info("request %s: step %d of %d", tracked.client_id or progress.request_id, progress.done,
                     progress.total)

    def _close(self, request_id: str, tracked: _Tracked, reason: str | None = None) -> None:
        with tracked.lock:
            if tracked.closed:
                return
            tracked.closed = True
            done = tracked.finished
            reason = reason or (done.reason if done else "stop")
            error = done.error if done and reason == done.reason else None
            tail = None if error else tracked.stream.finish(reason)
            if tail is not None and tail.data is not None:  # media held back to the end (an assembled clip)
                tracked.sink(OutputEvent(modality=tail.modality, data=tail.data, prompt_tokens=tracked.prompt_tokens))
            if tracked.session is not None:  # idle before the client hears of the end: its next request may follow
                self._finish_session(tracked.session, done, reason)
            final = OutputEvent(finish_reason=reason, error=error, prompt_tokens=tracked.prompt_tokens,
                                text=tail.text if tail else "",
                                completion_tokens=tracked.stream.generated,
                                error_status=_error_status(done) if error else None,
                                error_field=done.field if error else None)
            # the id is free before the client hears of the end: its next request may reuse it
            # at once (after the end, a resubmission could race the release and get a 409)
            self.tracked.pop(request_id, None)
            self._forget_id(tracked.client_id)
            tracked.sink(final)
            tracked.sink(None)



@dataclass
class _Recovery:
    """The restart policy (``Runtime.supervise``) and what it has done so far."""

    max_restarts: int
    on_give_up: Callable[[str], None] | None
    outcome: str  # what giving up leads to, for the failure's text
    attempts: dict[int, int] = field(default_factory=dict)  # rank -> restarts so far
    loading: set[int] = field(default_factory=set)  # ranks restarted and not ready yet
    gave_up: bool = False


def _error_status(done: Finished | None) -> int | None:
    """The HTTP status of a failed request: an engine's ``RequestError`` its own (4xx), 504
    timed out, 503 its worker died, else 500."""
    if done is None:
        return None
    if done.status is not None:
        return done.status
    if done.reason == "timeout":
        return 504
    if done.failed_rank is not None:
        return 503
    return None
