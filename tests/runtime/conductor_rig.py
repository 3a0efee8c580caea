"""The conductor test rig: a small model graph and ``Rig``, which drives the conductor with
fabricated step results and checks the scheduling contract on every tick (see test_conductor)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from mstar.graph import (
    Emit,
    EngineKind,
    Graph,
    Loop,
    Node,
    Parallel,
    Sequential,
    Step,
    Walk,
)
from mstar.graph import cursor as walk_cursor
from mstar.runtime.conductor import Conductor, Decisions, Finished, RequestSpec
from mstar.runtime.placement import NodeGroup, Placement, single_rank
from mstar.runtime.protocol import ItemResult, StepPlan, StepResult, WorkItem

# ---------------------------------------------------------------- the model graph


def make_graph() -> Graph:
    nodes = [
        Node("encoder", EngineKind.STATELESS, inputs=("image",), outputs=("out",)),
        Node("llm", EngineKind.AUTOREGRESSIVE, inputs=("ids", "embeds", "tok"), outputs=("tok",),
             ops=("prefill", "decode"), flags=("stop",)),
        Node("left", EngineKind.STATELESS, inputs=("x",), outputs=("y",)),
        Node("right", EngineKind.STATELESS, inputs=("x",), outputs=("y",)),
        Node("join", EngineKind.STATELESS, inputs=("a", "b"), outputs=("z",)),
        Node("painter", EngineKind.DENOISE, inputs=("x",), outputs=("img",)),
    ]

    def decode_loop() -> Loop:
        return Loop(Step("llm", "decode", reads="tok", writes="tok", emit=Emit("tok", "text")),
                    until="stop", max_iters="max_decode_steps")

    chat = Walk("chat", Sequential(
        Step("llm", "prefill", reads={"ids": "prompt"}, writes="tok", emit=Emit("tok", "text")),
        decode_loop(),
    ), inputs="prompt")
    vision = Walk("vision", Sequential(
        Step("encoder", reads="image", writes={"out": "emb"}),
        Step("llm", "prefill", reads={"ids": "prompt", "embeds": "emb"}, writes="tok", emit=Emit("tok", "text")),
        decode_loop(),
    ), inputs=("image", "prompt"))
    fork = Walk("fork", Sequential(
        Parallel(Step("left", reads="x", writes={"y": "ya"}),
                 Step("right", reads="x", writes={"y": "yb"})),
        Step("join", reads={"a": "ya", "b": "yb"}, writes="z", emit=Emit("z", "image")),
    ), inputs="x")
    # A walk that may have nothing to do at all (zero images asked for).
    paint = Walk("paint", Loop(Step("painter", reads="x", writes="img", emit=Emit("img", "image")),
                               max_iters="n"), inputs="x")
    return Graph.build(nodes, [chat, vision, fork, paint])


GRAPH = make_graph()


def two_ranks(graph: Graph = GRAPH) -> Placement:
    """encoder and left on rank 0; llm, right and join on rank 1."""
    return Placement(graph, (
        NodeGroup(("encoder", "left", "painter"), (0,)),
        NodeGroup(("llm", "right", "join"), (1,)),
    ))


# ------------------------------------------------------------------------ the rig

How = dict[str, Any] | Callable[[WorkItem], dict[str, Any]] | None


class Rig:
    def __init__(self, placement: Placement | None = None, *, max_concurrent: int = 16,
                 capacity: dict[str, int] | None = None, graph: Graph = GRAPH):
        self.graph = graph
        self.placement = placement or single_rank(graph)
        self.c = Conductor(graph, self.placement, max_concurrent_requests=max_concurrent, capacity=capacity)
        self.max_concurrent = max_concurrent
        self.capacity = dict(capacity or {})
        self.now = 0.0
        self.outstanding: dict[int, StepPlan] = {}  # rank -> plan with items, not answered yet
        self.failed: set[int] = set()
        self.specs: dict[str, RequestSpec] = {}
        self.order: list[str] = []  # submission order
        self.admitted: list[str] = []
        self.finished: dict[str, Finished] = {}
        self.touched: dict[str, set[int]] = {}
        self.contacted: set[tuple[str, int]] = set()
        self.released: Counter[tuple[str, int]] = Counter()
        self.latest: dict[str, dict[str, int]] = {}  # request -> var -> last completed version
        self.used_versions: dict[str, set[int]] = {}
        self.emitted: Counter[str] = Counter()
        self.items: dict[str, list[WorkItem]] = {}  # every item dispatched, per request
        self.plans: list[tuple[int, StepPlan]] = []  # every plan sent
        self.release_only: list[StepResult] = []  # answers owed for plans without items
        self.progress: list[tuple[str, int, int]] = []  # every progress report, in order

    # ------------------------------------------------------------------ events
    def submit(self, rid: str, walk: str = "chat", *, cost: dict[str, int] | None = None,
               deadline: float | None = None, peak: dict[str, int] | None = None, **params) -> None:
        if walk in ("chat", "vision"):
            params.setdefault("max_decode_steps", 4)
        if walk == "paint":
            params.setdefault("n", 2)
        spec = RequestSpec(rid, walk, params, dict(cost or {}), deadline, dict(peak or {}))
        self.c.submit(spec)
        if rid in self.finished:  # an id reused once the earlier request ended
            self.assert_released(rid)
            for book in (self.finished, self.touched, self.latest, self.used_versions, self.items):
                book.pop(rid, None)
            self.emitted.pop(rid, None)
            self.contacted = {(r, k) for r, k in self.contacted if r != rid}
            self.released = Counter({(r, k): n for (r, k), n in self.released.items() if r != rid})
            self.order.remove(rid)
            self.admitted.remove(rid)
        self.specs[rid] = spec
        self.order.append(rid)
        # the runtime sends a request's inputs at submit to every rank reading one of its walk's
        # variables: those ranks hold something of it from the start, and must release it
        self.touched[rid] = set().union(*self.c.routes[walk].readers.values())
        self.latest[rid] = {var: 0 for var in self.graph.walk(walk).inputs}
        self.used_versions[rid] = {0}
        self.items[rid] = []

    def cancel(self, rid: str, reason: str = "cancelled") -> None:
        self.c.cancel(rid, reason)

    def fail_rank(self, rank: int, error: str = "segfault") -> None:
        self.c.on_rank_failed(rank, error)
        self.failed.add(rank)
        self.outstanding.pop(rank, None)  # its results never come

    def tick(self, now: float | None = None) -> Decisions:
        if now is not None:
            self.now = now
        queued = [w.request_id for w in self.c.waiting]
        d = self.c.tick(self.now)
        self.progress += [(p.request_id, p.done, p.total) for p in d.progress]
        for done in d.finished:
            self._finished(done)
        # Admitted this tick: left the queue without timing out there (a request admitted
        # this tick cannot time out in it: deadlines are checked before admission).
        still = {w.request_id for w in self.c.waiting}
        timed_out = {f.request_id for f in d.finished if f.reason == "timeout"}
        for rid in queued:
            if rid not in still and rid not in timed_out:
                self._admitted(rid)
        for rank, plan in d.plans.items():
            self._check_plan(rank, plan)
        self._check_state()
        return d

    def settle(self, max_ticks: int = 100) -> None:
        """Tick as the runtime loop does between events: at once again while
        ``has_work_for_idle_rank`` says the next tick can do something, and each such tick
        must do it (send a plan, finish or admit a request): no spinning while the ranks are
        busy. Once it says there is nothing, the loop waits for an event, so a tick then (the
        wait timing out) must do nothing either."""
        for _ in range(max_ticks):
            promised = self.c.has_work_for_idle_rank()
            before = (len(self.plans), len(self.finished), len(self.c.waiting))
            self.tick()
            did = (len(self.plans), len(self.finished), len(self.c.waiting)) != before
            if not promised:
                assert not did, "the loop would wait for an event while a tick had work to do"
                return
            assert did, "has_work_for_idle_rank() promised work to a tick that had none: the loop would spin"
        raise AssertionError(f"still work for an idle rank after {max_ticks} ticks")

    def answer(self, rank: int, how: How = None, **per_request: How) -> StepResult:
        """Answer ``rank``'s plan in flight. ``how`` (or ``per_request[request_id]``) is a
        dict of ItemResult fields, or a function of the WorkItem returning one. By default
        an item succeeds and reports one emit message per emitted port, like a worker."""
        plan = self.outstanding.pop(rank)
        results = []
        for item in plan.items:
            spec = per_request.get(item.request_id, how)
            fields = spec(item) if callable(spec) else dict(spec or {})
            fields = dict(fields or {})
            ran = not fields.get("error") and not fields.get("preempted")
            fields.setdefault("emitted", len(item.emit) if ran else 0)
            results.append(ItemResult(item.request_id, item.step, **fields))
            self.emitted[item.request_id] += fields["emitted"]
            if ran:
                for ref in item.writes.values():
                    self.latest[item.request_id][ref.var] = ref.version
        result = StepResult(rank, plan.plan_id, results)
        self.c.on_result(result)
        return result

    def answer_all(self, how: How = None, **per_request: How) -> None:
        for rank in sorted(self.outstanding):
            self.answer(rank, how, **per_request)

    def step(self, how: How = None, **per_request: How) -> Decisions:
        """Answer everything in flight, then tick."""
        self.answer_all(how, **per_request)
        return self.tick()

    def drain(self, how: How = None, max_ticks: int = 1000, **per_request: How) -> None:
        """Tick and answer until nothing is left to do."""
        for _ in range(max_ticks):
            self.tick()
            if not self.outstanding and self.c.idle:
                return
            self.answer_all(how, **per_request)
        raise AssertionError("the conductor did not go idle")

    # --------------------------------------------------------------- checks
    def _admitted(self, rid: str) -> None:
        # FIFO: everything submitted earlier was admitted already or left the queue.
        for earlier in self.order[: self.order.index(rid)]:
            assert earlier in self.admitted or earlier in self.finished, f"{rid} overtook {earlier}"
        self.admitted.append(rid)

    def _finished(self, done: Finished) -> None:
        rid = done.request_id
        assert rid in self.specs, f"finished unknown request {rid}"
        assert rid not in self.finished, f"{rid} finished twice"
        self.finished[rid] = done
        assert done.emitted == self.emitted[rid], (rid, done.emitted, self.emitted[rid])
        assert not self._in_flight(rid), f"{rid} finished with work in flight"
        if done.reason == "error":
            assert done.error
        assert rid not in self.c.live and all(w.request_id != rid for w in self.c.waiting)

    def _in_flight(self, rid: str) -> list[WorkItem]:
        return [i for plan in self.outstanding.values() for i in plan.items if i.request_id == rid]

    def _check_plan(self, rank: int, plan: StepPlan) -> None:
        assert rank not in self.failed, f"plan sent to failed rank {rank}"
        assert rank not in self.outstanding, (
            f"plan sent to rank {rank} while its plan {self.outstanding[rank].plan_id} is in flight")
        assert plan.items or plan.release, "empty plan"
        assert all(plan.plan_id > p.plan_id for _, p in self.plans), "plan ids must grow"
        self.plans.append((rank, plan))
        for rid in plan.release:
            assert rid in self.finished, f"release of {rid}, which has not finished"
            assert rank in self.touched[rid], f"release of {rid} on rank {rank}, which it never touched"
            assert not self._in_flight(rid), f"release of {rid} while its work is in flight"
            self.released[(rid, rank)] += 1
            assert self.released[(rid, rank)] == 1, f"{rid} released twice on rank {rank}"
        seen_steps = set()
        for item in plan.items:
            self._check_item(rank, item)
            assert (item.request_id, item.step) not in seen_steps
            seen_steps.add((item.request_id, item.step))
        if plan.items:
            self.outstanding[rank] = plan
        else:
            self.release_only.append(StepResult(rank, plan.plan_id))

    def _check_item(self, rank: int, item: WorkItem) -> None:
        rid = item.request_id
        assert rid in self.admitted and rid not in self.finished, f"work for {rid}, which is not running"
        walk = self.graph.walk(self.specs[rid].walk)
        steps = [s for s in walk.steps() if s.name == item.step]
        assert len(steps) == 1, item.step
        step = steps[0]
        assert (item.node, item.op) == (step.node, step.op)
        assert self.placement.rank_of(walk.name, step.node) == rank, f"{item.step} sent to rank {rank}"
        assert all(i.step != item.step for i in self._in_flight(rid)), f"{item.step} dispatched twice"
        # params on first contact with this rank only
        first = (rid, rank) not in self.contacted
        assert (item.params is not None) == first, (rid, rank, item.params)
        if first:
            assert item.params == self.specs[rid].params
        self.contacted.add((rid, rank))
        self.touched[rid].add(rank)
        # reads: the latest completed version; writes: fresh versions
        assert {p: ref.var for p, ref in item.reads.items()} == dict(step.reads)
        for ref in item.reads.values():
            assert ref.version == self.latest[rid][ref.var], (item.step, ref, self.latest[rid])
        assert {p: ref.var for p, ref in item.writes.items()} == dict(step.writes)
        for ref in item.writes.values():
            assert ref.version not in self.used_versions[rid], f"version {ref.version} reused"
            self.used_versions[rid].add(ref.version)
        # send: every other rank that reads the variable; emit: the emitted ports
        for port, var in step.writes:
            readers = {self.placement.rank_of(walk.name, s.node) for s in walk.steps() if var in s.read_vars}
            assert item.send.get(port, []) == sorted(readers - {rank}), (item.step, port, item.send)
        assert set(item.send) <= {p for p, _ in step.writes}
        emits = {e.var: e.modality.value for e in step.emit}
        assert item.emit == {p: emits[v] for p, v in step.writes if v in emits}
        self.items[rid].append(item)

    def _check_state(self) -> None:
        c = self.c
        assert len(c.live) <= self.max_concurrent
        for name, cap in self.capacity.items():
            held = sum(live.spec.cost.get(name, 0) for live in c.live.values())
            assert c.in_use[name] == held <= cap, (name, c.in_use[name], held, cap)
        # busy ranks are exactly the ranks whose plan with items is in flight
        assert set(c.busy) == set(self.outstanding), (c.busy, set(self.outstanding))
        for rank, plan in self.outstanding.items():
            assert c.busy[rank] == plan.plan_id
        # continuous batching: no ready step is left behind on an idle rank
        for rid, live in c.live.items():
            if live.ending is not None:
                continue
            walk = self.graph.walk(live.spec.walk)
            for ready in walk_cursor.ready(walk.body, live.cursor):
                rank = self.placement.rank_of(walk.name, ready.step.node)
                assert rank in self.outstanding or rank in self.failed, (
                    f"{rid}: {ready.step.name} left on idle rank {rank}")

    def assert_released(self, rid: str) -> None:
        for rank in self.touched[rid]:
            # a rank that failed gets its release only if it was sent before the failure
            expected = (0, 1) if rank in self.failed else (1,)
            assert self.released[(rid, rank)] in expected, (rid, rank, self.released[(rid, rank)])

    def assert_quiescent(self) -> None:
        assert not self.outstanding
        assert self.c.idle
        assert not self.c.live and not self.c.waiting and not self.c.busy
        assert all(v == 0 for v in self.c.in_use.values()), self.c.in_use
        assert not self.c.has_work_for_idle_rank()
        for rid in self.order:
            assert rid in self.finished, f"{rid} never finished"
            self.assert_released(rid)
        assert not self.tick().plans  # nothing more to say

    # ------------------------------------------------------------- queries
    def ops(self, d: Decisions, rank: int = 0) -> list[tuple[str, str, int]]:
        plan = d.plans.get(rank)
        return [(i.request_id, i.op if i.node == "llm" else i.step, i.iteration) for i in (plan.items if plan else [])]

    def releases(self, d: Decisions, rank: int = 0) -> list[str]:
        plan = d.plans.get(rank)
        return list(plan.release) if plan else []

    def reasons(self, d: Decisions) -> dict[str, str]:
        return {f.request_id: f.reason for f in d.finished}


STOP = {"flags": ["stop"], "finish_reason": "stop"}
