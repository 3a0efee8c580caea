"""The conductor: holds each request's walk cursor and decides what runs next.

Its core has no sockets, clocks, threads or torch: events go in (``submit``, ``cancel``,
``on_result``, ``on_rank_failed``), and ``tick(now)`` returns the plans to send and the
requests that ended. It is tested with fabricated step results; the runtime loop that
owns sockets calls it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from mstar.config import StreamPacingConfig
from mstar.graph import Graph, Step, Walk
from mstar.graph import cursor as walk_cursor
from mstar.graph.walk import iter_steps
from mstar.runtime.pacing import Pace, held_streams
from mstar.runtime.placement import Placement, Routes, all_routes
from mstar.runtime.protocol import (
    ChunkRef,
    ItemResult,
    SessionRef,
    StepPlan,
    StepResult,
    VarRef,
    WorkItem,
)
from mstar.runtime.streams import EdgeTimes, StreamState


@dataclass(frozen=True)
class RequestSpec:
    """A request as the conductor sees it: metadata only, never tensors."""

    request_id: str
    walk: str
    params: dict[str, Any]
    cost: dict[str, int] = field(default_factory=dict)  # resource -> units held while admitted
    deadline: float | None = None  # absolute time after which it fails with "timeout"
    # resource -> the most units it may come to hold, beyond ``cost`` (KV pages reserved as its
    # tokens grow, preempted by the engine when they run out): admission counts ``cost``, and
    # a request whose peak is more than the whole pool is refused.
    peak: dict[str, int] = field(default_factory=dict)
    session: SessionRef | None = None  # the session its steps run in (``mstar.runtime.sessions``)


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: str  # the last finish_reason a step gave, "cancelled", "error" or "timeout"
    error: str | None
    emitted: int  # emit messages the frontend must have received before closing
    profile: dict[str, float] = field(default_factory=dict)
    failed_rank: int | None = None  # set when it failed because this worker rank died
    status: int | None = None  # an engine's RequestError: the client's mistake, its 4xx ...
    field: str | None = None  # ... and the request field it names


@dataclass
class _Live:
    spec: RequestSpec
    cursor: Any
    walk: Walk  # the walk ``spec.walk`` names, and its routes: looked up once, not per step
    routes: Routes
    ctx: walk_cursor.LoopContext  # what its loops consult: its flags and parameters (new when flags change)
    flags: frozenset[str] = frozenset()
    versions: dict[str, int] = field(default_factory=dict)
    next_version: int = 1
    in_flight: dict[int, tuple[int, dict[str, int]]] = field(default_factory=dict)  # id(step) -> (rank, writes)
    ranks_seen: set[int] = field(default_factory=set)
    emitted: int = 0
    finish_reason: str = "stop"
    streams: list[StreamState] = field(default_factory=list)
    inputs_ended: bool = False  # the client sent end_input: its client streams close
    ending: Finished | None = None  # set once it must end; released when nothing is in flight
    profile: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """A request finished iteration ``done`` of the ``total`` of a Loop that reports progress."""

    request_id: str
    done: int
    total: int


@dataclass
class Decisions:
    plans: dict[int, StepPlan] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)


class AdmissionError(ValueError):
    """A request that can never be admitted (it needs more than the whole pool)."""


class Conductor:
    def __init__(self, graph: Graph, placement: Placement, *, max_concurrent_requests: int,
                 capacity: dict[str, int] | None = None, pacing: StreamPacingConfig | None = None):
        self.graph = graph
        # Streaming-aware scheduling (``mstar.runtime.pacing``): the media clock of each
        # request whose first media reached its client (``note_media``, from the emit thread),
        # and, after a tick that ran nothing because streams were ahead, how long until one
        # of them needs a step (``pacing_wait``).
        self.pacing = pacing
        self.paces: dict[str, Pace] = {}
        self.pacing_wait: float | None = None
        self.paced_holds = 0  # request-ticks whose producing steps sat out (a gauge for tests and stats)
        self.routes: dict[str, Routes] = all_routes(graph, placement)
        self.ranks = placement.ranks
        self.max_concurrent = max_concurrent_requests
        self.capacity = dict(capacity or {})
        self.in_use = {name: 0 for name in self.capacity}
        self.waiting: deque[RequestSpec] = deque()
        self.live: dict[str, _Live] = {}
        self.busy: dict[int, int] = {}  # rank -> plan id in flight
        self.releases: dict[int, list[str]] = {rank: [] for rank in self.ranks}
        self.session_drops: dict[int, list[str]] = {rank: [] for rank in self.ranks}
        self.failed_ranks: dict[int, str] = {}
        self._plan_ids = 0
        # Client-stream items of requests not admitted yet: request id -> [(var, version)],
        # and the requests whose input ended before admission (``append``, ``end_input``).
        self._early_items: dict[str, list[tuple[str, int]]] = {}
        self._early_ends: set[str] = set()
        self._ended: list[Finished] = []
        self._progress: list[Progress] = []
        # Per-step constants, computed once: walk -> step name -> its steps; (step, rank) ->
        # where its outputs go and which of them stream to the client.
        self._steps_named = {name: _steps_by_name(walk) for name, walk in graph.walks.items()}
        self._reports_progress = {name for name, walk in graph.walks.items() if walk_cursor.has_progress(walk.body)}
        self._outlets: dict[tuple[int, int], tuple[dict[str, list[int]], dict[str, str]]] = {}
        self._droppable = {name: _droppable_sources(walk) for name, walk in graph.walks.items()}
        self._edge_times: dict[int, EdgeTimes] = {}  # id(edge) -> its streams' latest timings (timed policies)
        self._edges = {name: _edge_facts(walk) for name, walk in graph.walks.items()}

    # ----------------------------------------------------------------- events
    def submit(self, spec: RequestSpec) -> None:
        self.graph.walk(spec.walk)  # unknown walk: GraphError now, not later
        for name, units in (spec.peak | spec.cost).items():
            units = max(units, spec.peak.get(name, 0))
            if name not in self.capacity:
                raise AdmissionError(f"request needs resource {name!r}, which this deployment does not have")
            if units > self.capacity[name]:
                raise AdmissionError(
                    f"request needs {units} units of {name!r} but the whole pool holds {self.capacity[name]}"
                )
        if spec.request_id in self.live or any(w.request_id == spec.request_id for w in self.waiting):
            raise AdmissionError(f"request id {spec.request_id!r} is already in use")
        self.waiting.append(spec)

    def cancel(self, request_id: str, reason: str = "cancelled", error: str | None = None) -> None:
        for spec in self.waiting:
            if spec.request_id == request_id:
                self.waiting.remove(spec)
                self._end_waiting(spec, Finished(request_id, reason, error, 0))
                return
        live = self.live.get(request_id)
        if live is not None and live.ending is None:
            live.ending = Finished(request_id, reason, error, live.emitted, live.profile)

    def append(self, request_id: str, var: str, version: int) -> None:
        """The client appended an item to the request's client stream ``var``; its tensor
        was sent, as ``version``, to the ranks that read it. Unknown requests are ignored
        (it ended meanwhile)."""
        live = self.live.get(request_id)
        if live is None:
            if any(w.request_id == request_id for w in self.waiting):
                self._early_items.setdefault(request_id, []).append((var, version))
            return
        if live.inputs_ended or live.ending is not None:
            return
        for stream in live.streams:
            if stream.edge.source == var:
                stream.versions.append(version)

    def end_input(self, request_id: str, last_items: list[tuple[str, int]] = ()) -> None:
        """The client ended its input, with ``last_items`` (``(var, version)``: each client
        stream's empty end marker, whose chunk is the stream's ``last``): the request's client
        streams close once drained, and the stages fed by them after."""
        for var, version in last_items:
            self.append(request_id, var, version)
        live = self.live.get(request_id)
        if live is None:
            if any(w.request_id == request_id for w in self.waiting):
                self._early_ends.add(request_id)
            return
        live.inputs_ended = True
        self._check_done(live)

    def drop_sessions(self, session_ids: list[str]) -> None:
        """Every live rank frees these sessions' kept state with its next plan, before that
        plan's items (a rank that holds none of it has nothing to free)."""
        for rank in self.ranks:
            if rank not in self.failed_ranks:
                self.session_drops[rank].extend(session_ids)

    def on_result(self, result: StepResult) -> None:
        if self.busy.get(result.rank) == result.plan_id:
            del self.busy[result.rank]
        share = [(node, seconds / max(1, len(result.results))) for node, seconds in result.profile.items()]
        for item in result.results:
            live = self.live.get(item.request_id)
            if live is not None:
                prof = live.profile
                for node, seconds in share:
                    prof[node] = prof.get(node, 0.0) + seconds
                self._apply(item, live)

    def on_rank_failed(self, rank: int, error: str) -> list[str]:
        """A worker died: every request with work there fails, and none is sent there again.
        Returns the ids of the requests it failed."""
        self.failed_ranks[rank] = error
        self.busy.pop(rank, None)
        self.releases[rank] = []  # never sent: releases still owed to it would keep idle False
        self.session_drops[rank] = []
        failed = []
        for live in self.live.values():
            if rank in live.ranks_seen:
                live.in_flight = {k: v for k, v in live.in_flight.items() if v[0] != rank}
                if live.ending is None:
                    live.ending = Finished(live.spec.request_id, "error", f"worker rank {rank} failed: {error}",
                                           live.emitted, live.profile, failed_rank=rank)
                    failed.append(live.spec.request_id)
        return failed

    def on_rank_restarted(self, rank: int) -> list[str]:
        """A new worker process serves ``rank``: plans go there again. Live requests whose
        walk uses the rank fail (what they sent it died with the old process); the rank's
        pending releases are dropped (the new process holds nothing). Returns the ids of
        the requests it failed."""
        error = self.failed_ranks.pop(rank, "restarted")
        self.busy.pop(rank, None)
        self.releases[rank] = []
        self.session_drops[rank] = []
        failed = []
        for live in self.live.values():
            uses_rank = rank in self.routes[live.spec.walk].step_rank.values()
            if uses_rank and live.ending is None:
                live.ending = Finished(live.spec.request_id, "error", f"worker rank {rank} failed: {error}",
                                       live.emitted, live.profile, failed_rank=rank)
                failed.append(live.spec.request_id)
        return failed

    # ------------------------------------------------------------- scheduling
    def note_media(self, request_id: str, seconds: float, now: float) -> None:
        """The request has sent ``seconds`` of media to its client in all (safe to call from
        another thread: one dict assignment). Kept only when the deployment paces streams."""
        if self.pacing is not None and request_id in self.live:
            pace = self.paces.get(request_id)
            self.paces[request_id] = Pace(pace.started_at if pace else now, seconds)

    def tick(self, now: float) -> Decisions:
        self._expire(now)
        self._admit()
        held = self._held(now)
        self.paced_holds += len(held)
        items: dict[int, list[WorkItem]] = {rank: [] for rank in self.ranks}
        for live in list(self.live.values()):
            if live.ending is not None:
                if not live.in_flight:
                    self._release(live)
                continue
            walk, routes = live.walk, live.routes
            steps = walk_cursor.ready(walk.body, live.cursor)
            dead = next((r for r in (routes.rank(s.step) for s in steps) if r in self.failed_ranks),
                        None) if self.failed_ranks else None
            if dead is not None:  # its next step needs a dead rank: fail it rather than wait forever
                live.ending = Finished(live.spec.request_id, "error",
                                       f"worker rank {dead} failed: {self.failed_ranks[dead]}",
                                       live.emitted, live.profile, failed_rank=dead)
                if not live.in_flight:
                    self._release(live)
                continue
            for ready in () if held and live.spec.request_id in held else steps:
                rank = routes.step_rank[id(ready.step)]
                if rank in self.busy or rank in self.failed_ranks:
                    continue
                items[rank].append(self._dispatch(live, ready.step, ready.iteration, rank, routes))
            for stream, facts in zip(live.streams, self._edges[walk.name]) if live.streams else ():
                stream.observe(now)
                rank = routes.step_rank[id(stream.edge.into)]
                if rank in self.busy or rank in self.failed_ranks:
                    continue
                if facts.other_reads and any(var not in live.versions for var in facts.other_reads):
                    continue  # its other inputs (a primed state) are not written yet
                chunk = stream.next_chunk()
                if chunk is not None:
                    ref = stream.take(chunk)
                    items[rank].append(self._dispatch(live, stream.edge.into, chunk.index, rank, routes, ref))
            self._check_done(live)
        decisions = Decisions(finished=self._ended, progress=self._progress)
        self._ended, self._progress = [], []
        self.pacing_wait = None
        for rank in self.ranks:
            if rank in self.busy or rank in self.failed_ranks:
                continue
            if items[rank] or self.releases[rank] or self.session_drops[rank]:
                self._plan_ids += 1
                decisions.plans[rank] = StepPlan(self._plan_ids, items[rank], self.releases[rank],
                                                 self.session_drops[rank])
                self.releases[rank], self.session_drops[rank] = [], []
                if items[rank]:
                    self.busy[rank] = self._plan_ids
        if held and not self.busy:  # nothing runs until a held stream needs a step
            soonest = min((self.paces[r].slack(now) for r in held if r in self.paces), default=0.0)
            self.pacing_wait = max(0.0, soonest - self.pacing.ahead_s)
        return decisions

    def _held(self, now: float) -> set[str]:
        """The streaming requests whose producing steps sit out this tick (none without pacing)."""
        if self.pacing is None or not self.paces:
            return set()
        for gone in [rid for rid in list(self.paces) if rid not in self.live]:  # noted as it was released
            del self.paces[gone]
        streaming = [rid for rid, live in self.live.items() if live.streams and live.ending is None]
        return held_streams(streaming, self.paces, now, ahead_s=self.pacing.ahead_s,
                            max_streams=self.pacing.max_streams)

    def _admit(self) -> None:
        while self._admissible():  # first come, first served: nothing overtakes the head of the queue
            spec = self.waiting.popleft()
            for name, units in spec.cost.items():
                self.in_use[name] += units
            walk = self.graph.walk(spec.walk)
            ctx = walk_cursor.LoopContext(frozenset(), spec.params)
            live = _Live(spec, walk_cursor.start(walk.body, ctx), walk, self.routes[walk.name], ctx)
            live.versions = {var: 0 for var in walk.inputs}
            live.streams = [StreamState(edge, droppable=edge.source in self._droppable[walk.name],
                                        edge_times=self._edge_times.setdefault(id(edge), EdgeTimes()))
                            for edge in walk.streams]
            for var, version in self._early_items.pop(spec.request_id, ()):
                for stream in live.streams:
                    if stream.edge.source == var:
                        stream.versions.append(version)
            if spec.request_id in self._early_ends:
                self._early_ends.discard(spec.request_id)
                live.inputs_ended = True
            if walk_cursor.is_done(live.cursor):  # nothing to run (e.g. a Loop with a zero budget)
                live.ending = Finished(spec.request_id, live.finish_reason, None, 0)
            self.live[spec.request_id] = live

    def _dispatch(self, live: _Live, step: Step, iteration: int, rank: int, routes: Routes,
                  chunk: ChunkRef | None = None) -> WorkItem:
        if chunk is None:
            live.cursor = walk_cursor.mark_running(live.walk.body, live.cursor, step)
        versions = live.versions
        reads = {port: VarRef(var, versions[var]) for port, var in step.reads if chunk is None or port != chunk.port}
        writes: dict[str, VarRef] = {}
        written: dict[str, int] = {}
        version = live.next_version
        for port, var in step.writes:
            writes[port] = VarRef(var, version)
            written[var] = version
            version += 1
        live.next_version = version
        live.in_flight[id(step)] = (rank, written)
        outlets = self._outlets.get((id(step), rank))
        if outlets is None:
            send = {port: dests for port, var in step.writes if (dests := routes.destinations(var, exclude=rank))}
            emit = {port: e.modality.value for e in step.emit for port, var in step.writes if var == e.var}
            outlets = self._outlets[(id(step), rank)] = (send, emit)
        send, emit = outlets
        first = rank not in live.ranks_seen
        live.ranks_seen.add(rank)
        return WorkItem(live.spec.request_id, step.node, step.op, step.name, iteration, reads, writes,
                        send, emit, live.spec.params if first else None, chunk, live.spec.session)

    def _apply(self, item: ItemResult, live: _Live) -> None:
        walk = live.walk
        for step in self._steps_named[walk.name].get(item.step, ()):
            if id(step) in live.in_flight:
                break
        else:
            return
        _, written = live.in_flight.pop(id(step))
        if item.silent:
            silent = {var for port, var in step.writes if port in item.silent}
            written = {var: version for var, version in written.items() if var not in silent}
        live.emitted += item.emitted
        if item.finish_reason:
            live.finish_reason = item.finish_reason
        if live.ending is not None:
            live.ending = replace(live.ending, emitted=live.emitted, profile=live.profile)
            return
        if item.error is not None:
            live.ending = Finished(item.request_id, "error", item.error, live.emitted, live.profile,
                                   status=item.error_status, field=item.error_field)
            return
        if item.preempted:
            self._requeue(live, step)
            return
        live.versions.update(written)
        chunk_done = False  # the step is a stream edge's consumer: its chunk came back
        for stream in live.streams:
            if stream.edge.into is step:
                stream.running = False
                chunk_done = True
            elif stream.edge.source in written:
                stream.versions.append(written[stream.edge.source])
        if item.flags:
            live.flags = live.flags | frozenset(item.flags)
            live.ctx = walk_cursor.LoopContext(live.flags, live.spec.params)
        if not chunk_done:
            ctx = live.ctx
            before = walk_cursor.progress(walk.body, live.cursor, ctx) if walk.name in self._reports_progress else None
            live.cursor = walk_cursor.complete(walk.body, live.cursor, step, ctx)
            if before is not None:  # an iteration ended when the loop moved on (or was left)
                after = walk_cursor.progress(walk.body, live.cursor, ctx)
                if after is None or after[0] != before[0]:
                    self._progress.append(Progress(live.spec.request_id, before[0] + 1, before[1]))
        self._check_done(live)

    def _requeue(self, live: _Live, step: Step) -> None:
        """The engine gave ``step`` back unrun (preempted: its KV pages went to older
        requests). It is ready again with the same reads; nothing advanced, nothing was
        written, and the next tick dispatches it again. A stream-edge step cannot go back
        (its chunk was taken): the request fails rather than lose the chunk."""
        if any(stream.edge.into is step for stream in live.streams):
            live.ending = Finished(live.spec.request_id, "error", f"step {step.name!r} was preempted, and a "
                                   "stream-edge step cannot run again", live.emitted, live.profile)
            return
        live.cursor = walk_cursor.mark_pending(live.walk.body, live.cursor, step)

    def _check_done(self, live: _Live) -> None:
        """Streams close (see ``_close_streams``); the request ends once its body is done and
        every stream is drained."""
        if live.ending is not None:
            return
        body_done = walk_cursor.is_done(live.cursor)
        if live.streams:
            self._close_streams(live, body_done)
        if not body_done:
            return
        if not live.in_flight and all(stream.drained for stream in live.streams):
            live.ending = Finished(live.spec.request_id, live.finish_reason, None, live.emitted, live.profile)

    def _close_streams(self, live: _Live, body_done: bool) -> None:
        """A client stream closes when the client ends its input; a stream written by the
        body when the body is done; a stream written by another edge's consumer when every
        stream feeding that consumer is drained (edges are declared upstream first)."""
        streams = live.streams
        for stream, facts in zip(streams, self._edges[live.spec.walk]):
            if stream.closed:
                continue
            if facts.from_client:
                stream.closed = live.inputs_ended
                continue
            stream.closed = (body_done or not facts.by_body) and all(streams[i].drained for i in facts.feeders)

    def _release(self, live: _Live) -> None:
        self.paces.pop(live.spec.request_id, None)
        del self.live[live.spec.request_id]
        self._early_items.pop(live.spec.request_id, None)
        for name, units in live.spec.cost.items():
            self.in_use[name] -= units
        self._release_on(live.spec, live.ranks_seen)
        assert live.ending is not None
        self._ended.append(live.ending)

    def _end_waiting(self, spec: RequestSpec, ending: Finished) -> None:
        """A request that ends before admission: its inputs already sit on the ranks that
        read them (the runtime sends them at submit), so those ranks release it too."""
        self._early_items.pop(spec.request_id, None)
        self._early_ends.discard(spec.request_id)
        self._release_on(spec, set())
        self._ended.append(ending)

    def _release_on(self, spec: RequestSpec, ranks: set[int]) -> None:
        """Release the request on ``ranks`` and on every rank its walk's variables are sent to
        (a rank may hold its inputs without having run a step of it)."""
        readers = self.routes[spec.walk].readers.values()
        for rank in sorted(ranks.union(*readers)):
            if rank not in self.failed_ranks:
                self.releases[rank].append(spec.request_id)

    def _expire(self, now: float) -> None:
        for spec in list(self.waiting):
            if spec.deadline is not None and now >= spec.deadline:
                self.waiting.remove(spec)
                self._end_waiting(spec, Finished(spec.request_id, "timeout", "request timed out in the queue", 0))
        for live in self.live.values():
            if live.ending is None and live.spec.deadline is not None and now >= live.spec.deadline:
                live.ending = Finished(live.spec.request_id, "timeout", "request timed out", live.emitted, live.profile)

    # ---------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        """Requests submitted and not admitted yet (safe to read from another thread)."""
        return len(self.waiting)

    @property
    def num_live(self) -> int:
        """Requests admitted and not released yet (safe to read from another thread)."""
        return len(self.live)

    @property
    def idle(self) -> bool:
        return (not self.waiting and not self.live and not any(self.releases.values())
                and not any(self.session_drops.values()))

    def has_work_for_idle_rank(self) -> bool:
        """Whether the next tick can do something now, rather than after a worker's result:
        admit the head of the queue, report or release a request that ended (with nothing in
        flight), or send a rank that is not busy its releases and session drops. Requests
        queued behind a full house are not such work: while the ranks run the requests
        admitted, the runtime loop waits for an event instead of ticking in a spin (with 48
        chats queued behind 16 running, that spin kept a core of a 2-core machine from the
        worker computing the steps)."""
        if self._ended or self._admissible():
            return True
        if any(live.ending is not None and not live.in_flight for live in self.live.values()):
            return True
        return any(self.releases[rank] or self.session_drops[rank] for rank in self.ranks if rank not in self.busy)

    def _admissible(self) -> bool:
        """Whether ``_admit`` would take the head of the queue now."""
        if not self.waiting or len(self.live) >= self.max_concurrent:
            return False
        return all(self.in_use[name] + units <= self.capacity[name] for name, units in self.waiting[0].cost.items())


@dataclass(frozen=True)
class _EdgeFacts:
    """What the conductor asks of a walk's stream edge every tick, worked out once (the
    request's ``streams`` are the walk's edges, in order)."""

    from_client: bool  # its source is a client stream
    by_body: bool  # its source is written by the walk's body (not only by edges' consumers)
    feeders: tuple[int, ...]  # the edges whose consumer writes its source
    other_reads: tuple[str, ...]  # the variables its consumer reads besides the chunk


def _edge_facts(walk) -> tuple[_EdgeFacts, ...]:
    body_writes = {var for step in iter_steps(walk.body) for var in step.write_vars}
    return tuple(
        _EdgeFacts(from_client=walk.client_stream(edge.source) is not None, by_body=edge.source in body_writes,
                   feeders=tuple(i for i, other in enumerate(walk.streams) if edge.source in other.into.write_vars),
                   other_reads=tuple(var for port, var in edge.into.reads if port != edge.chunk_port))
        for edge in walk.streams)


def _droppable_sources(walk) -> set[str]:
    """The stream sources whose consumed items may be freed on the consumer's rank: read by
    that one edge's chunks only (no other edge, no plain read, not a walk output)."""
    plain = {var for step in walk.steps() for port, var in step.reads
             if not any(edge.into is step and port == edge.chunk_port for edge in walk.streams)}
    sources = [edge.source for edge in walk.streams]
    return {var for var in sources if sources.count(var) == 1 and var not in plain and var not in walk.outputs}


def _steps_by_name(walk) -> dict[str, list[Step]]:
    named: dict[str, list[Step]] = {}
    for step in walk.steps():
        named.setdefault(step.name, []).append(step)
    return named
