"""A worker: owns the nodes placed on its rank, runs the plans the conductor sends.

For each plan it frees released requests, waits for the input tensors its items read,
runs every node's items as one batch through the node's engine, sends outputs straight to
the ranks that read them next, streams emitted outputs straight to the frontend (one
message per plan), and returns one ``StepResult``.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import OrderedDict

import torch

from mstar.contract import RequestError
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.runtime.lockstep import drop_followers_sessions, take_follower_reports
from mstar.runtime.protocol import (
    EMIT_STACKED,
    ItemResult,
    StepPlan,
    StepResult,
    VarRef,
    WorkItem,
    emit_batch_key,
    emit_key,
    parse_abandon,
    parse_tensor_key,
    split_batch_key,
    tensor_key,
    unpack_values,
)
from mstar.runtime.sessions import SessionHandle, SessionStore
from mstar.runtime.transport import TensorTransport

log = logging.getLogger(__name__)

INPUT_TIMEOUT_S = 60.0
RELEASED_REMEMBERED = 65536  # released request ids a store keeps, to drop their late inputs


class TensorStore:
    """The worker's copy of walk variables: the latest version of each (request, variable),
    and every version of stream-edge sources (their items are consumed in chunks)."""

    def __init__(self, stream_vars: frozenset[str] = frozenset()) -> None:
        self.stream_vars = stream_vars
        self._values: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        # the latest released requests (late arrivals for them are dropped), oldest first
        self._released: OrderedDict[str, None] = OrderedDict()

    def put(self, request_id: str, var: str, version: int, value: torch.Tensor) -> None:
        if request_id in self._released:
            return  # a late arrival for a request that already ended
        versions = self._values.setdefault((request_id, var), {})
        if var not in self.stream_vars:
            if versions and max(versions) > version:
                return
            versions.clear()
        versions[version] = value

    def get(self, request_id: str, var: str, version: int) -> torch.Tensor | None:
        versions = self._values.get((request_id, var))
        return None if versions is None else versions.get(version)

    def get_reads(self, request_id: str, reads: dict[str, VarRef]) -> dict[str, torch.Tensor] | None:
        """The value each port of ``reads`` reads (port -> its variable's version), or None
        while one is missing (asked for every item of every plan)."""
        values = {}
        for port, ref in reads.items():
            held = self._values.get((request_id, ref.var))
            value = None if held is None else held.get(ref.version)
            if value is None:
                return None
            values[port] = value
        return values

    def get_all(self, request_id: str, var: str, versions: list[int]) -> list[torch.Tensor] | None:
        """The values of these versions of a stream variable, or None while one is missing
        (a codec window of 28 items: one look-up of the variable, not 28)."""
        held = self._values.get((request_id, var))
        if held is None:
            return None
        values = []
        for version in versions:  # (``None in values`` would compare each tensor with None: slow)
            value = held.get(version)
            if value is None:
                return None
            values.append(value)
        return values

    def released(self, request_id: str) -> bool:
        return request_id in self._released

    def drop(self, request_id: str) -> None:
        self._released[request_id] = None
        self._released.move_to_end(request_id)
        if len(self._released) > RELEASED_REMEMBERED:
            self._released.popitem(last=False)
        for key in [k for k in self._values if k[0] == request_id]:
            del self._values[key]

    def discard(self, request_id: str, var: str, versions: list[int]) -> None:
        """Free versions of a stream variable that no later step reads."""
        held = self._values.get((request_id, var))
        if held is not None:
            for version in versions:
                held.pop(version, None)

    def __len__(self) -> int:
        return len(self._values)


class Worker:
    def __init__(self, rank: int, engines: dict[str, Engine], transport: TensorTransport, frontend_rank: int,
                 stream_vars: frozenset[str] = frozenset()):
        self.rank = rank
        self.engines = engines
        self.transport = transport
        self.frontend_rank = frontend_rank
        self.store = TensorStore(stream_vars)
        self.params: dict[str, dict] = {}
        self.sessions = SessionStore()  # state kept between a session's requests (``mstar.runtime.sessions``)
        self._emits: list[tuple[str, torch.Tensor]] = []  # (emit key, value) streamed by this plan
        self._sends: dict[int, list[tuple[str, torch.Tensor]]] = {}  # rank -> (tensor key, value) for it
        self._dead_rank: int | None = None  # the rank of the latest abandon notice, for its errors

    def execute(self, plan: StepPlan) -> StepResult:
        self._emits = []
        self._sends = {}
        for request_id in plan.release:
            self._release(request_id)
        for session_id in plan.drop_sessions:
            self.sessions.drop(session_id)
        if plan.drop_sessions:  # a split group's followers keep their shards of the state
            drop_followers_sessions(self.engines, plan.drop_sessions)
        for item in plan.items:
            if item.params is not None:
                self.params[item.request_id] = item.params
        inputs = self._gather(plan.items)
        results: list[ItemResult] = []
        profile: dict[str, float] = {}
        by_node: dict[str, list[WorkItem]] = {}
        for item in plan.items:
            by_node.setdefault(item.node, []).append(item)
        for node, items in by_node.items():
            ready = [i for i in items if id(i) in inputs]
            if len(ready) < len(items):
                results += [ItemResult(i.request_id, i.step, error=self._why_missing(i))
                            for i in items if id(i) not in inputs]
            start = time.perf_counter()
            if _profiling():
                with torch.profiler.record_function(f"mstar.node.{node}"):  # a labelled range in GPU profiles
                    results += self._run_node(node, ready, inputs)
            else:
                results += self._run_node(node, ready, inputs)
            profile[node] = time.perf_counter() - start
        for item in plan.items:  # consumed stream items no later chunk reads
            if item.chunk is not None and item.chunk.drop:
                self.store.discard(item.request_id, item.chunk.var, item.chunk.drop)
        self._flush_sends()
        self._flush_emits()
        held = {item.session.id: self.sessions.nbytes(item.session.id) for item in plan.items if item.session}
        reports = take_follower_reports(self.engines) if held or plan.drop_sessions else {}
        return StepResult(self.rank, plan.plan_id, results, profile, self.stats(), held,
                          {rank: r.session_bytes for rank, r in reports.items() if r.session_bytes},
                          {rank: r.gauges for rank, r in reports.items()})

    def _run_node(self, node: str, items: list[WorkItem], inputs: dict) -> list[ItemResult]:
        engine = self.engines[node]
        params = self.params
        batch = [EngineItem(i.request_id, i.op, i.iteration, inputs[id(i)], params.get(i.request_id, {}), i.chunk,
                            None if i.session is None else self._session(node, i)) for i in items]
        try:
            outputs: list[EngineOutput | BaseException] = list(engine.run(batch))
        except Exception as err:
            if len(batch) == 1:
                outputs = [_failure(err)]
            else:  # find the culprit: every item alone, so only it fails
                outputs = []
                for one in batch:
                    try:
                        outputs += engine.run([one])
                    except Exception as alone:
                        outputs.append(_failure(alone))
        return [self._deliver(item, out) for item, out in zip(items, outputs)]

    def _deliver(self, item: WorkItem, out: EngineOutput | BaseException) -> ItemResult:
        if isinstance(out, BaseException):
            log.warning("request %s failed in %s: %s", item.request_id, item.step, out)
            mistake = out if isinstance(out, RequestError) else None
            return ItemResult(item.request_id, item.step, error=str(out), error_status=mistake and mistake.status,
                              error_field=mistake and mistake.field)
        if out.preempted:
            return ItemResult(item.request_id, item.step, preempted=True)
        emitted = 0
        silent = []
        for port, ref in item.writes.items():
            value = out.outputs.get(port)
            if value is None:
                silent.append(port)
                continue
            self.store.put(item.request_id, ref.var, ref.version, value)
            if not item.send and not item.emit:
                continue
            key = tensor_key(item.request_id, ref.var, ref.version)
            for dst in item.send.get(port, ()):
                self._sends.setdefault(dst, []).append((key, value))
            if port in item.emit:
                self._emits.append((emit_key(key, item.emit[port]), value))
                emitted += 1
        return ItemResult(item.request_id, item.step, list(out.flags), out.finish_reason, emitted=emitted,
                          silent=silent)

    def _session(self, node: str, item: WorkItem) -> SessionHandle | None:
        ref = item.session
        return None if ref is None else SessionHandle(self.sessions, ref.id, node, ref.resume)

    def _flush_sends(self) -> None:
        """Send the plan's outputs that other ranks read as one message per rank (a decode
        step of many requests writing a code each for a codec on another rank: one send,
        not one per request), keyed ``emit_batch_key`` of their tensor keys; ``accept``
        takes them apart."""
        for dst, pairs in self._sends.items():
            keys, values = zip(*pairs)
            self.transport.send(dst, emit_batch_key(list(keys)), _pack(list(values)))
        self._sends = {}

    def _flush_emits(self) -> None:
        """Stream the plan's outputs to the frontend as one message (one send, one wake-up
        of its receiving thread, however many requests the plan ran); values of one shape
        and dtype travel stacked, as one tensor (``emit_batch_key``)."""
        if not self._emits:
            return
        keys, values = zip(*self._emits)
        self._emits = []
        self.transport.send(self.frontend_rank, emit_batch_key(list(keys)), _pack(list(values)))

    def _gather(self, items: list[WorkItem]) -> dict[int, dict[str, torch.Tensor]]:
        """Wait until every item's inputs are in the store; give up after a timeout, or at
        once for an abandoned request (its inputs' sender died: see ``accept``)."""
        deadline = time.monotonic() + INPUT_TIMEOUT_S
        found: dict[int, dict[str, torch.Tensor]] = {}  # id(item) -> its inputs
        pending = list(items)
        while True:
            still = []
            for item in pending:
                values = self.store.get_reads(item.request_id, item.reads)
                if values is not None and item.chunk is not None:
                    chunk = self._chunk_input(item)
                    if chunk is None:
                        values = None
                    else:
                        values[item.chunk.port] = chunk
                if values is not None:
                    found[id(item)] = values
                elif not self.store.released(item.request_id):
                    still.append(item)
            pending = still
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return found
            for key, tensors in self.transport.recv(timeout=min(remaining, 0.5)):
                self.accept(key, tensors)

    def _chunk_input(self, item: WorkItem) -> torch.Tensor | None:
        """The chunk's items concatenated along the first dimension, once all are here."""
        chunk = item.chunk
        parts = self.store.get_all(item.request_id, chunk.var, chunk.versions)
        if parts is None:
            return None
        # A part of one dimension or more is its own rows: only a scalar needs a view (a window
        # of 28 Orpheus codes is 28 parts, and a reshape each cost more than the cat), and
        # ``cat`` itself refuses a scalar, so the parts are looked at only then.
        try:
            return torch.cat(parts)
        except RuntimeError:
            if all(p.dim() for p in parts):
                raise
        return torch.cat([p if p.dim() else p.reshape(1) for p in parts])

    def _why_missing(self, item: WorkItem) -> str:
        if self.store.released(item.request_id):
            return f"gave up waiting for inputs: worker rank {self._dead_rank} was declared dead"
        return "timed out waiting for inputs"

    def accept(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """A tensor another rank (or the frontend) sent: one value (``{"value": ...}``), or a
        plan's worth for this rank (``_flush_sends``); or the frontend's notice that a rank
        died and the requests it failed are abandoned: their inputs are dropped (as those of
        a released request), so a step waiting for them fails now, not at the timeout."""
        abandoned = parse_abandon(key)
        if abandoned is not None:
            self._dead_rank, request_ids = abandoned
            for request_id in request_ids:
                self.store.drop(request_id)
            return
        if "value" in tensors:
            pairs = [(key, tensors["value"])]
        else:
            keys = split_batch_key(key)
            pairs = list(zip(keys, unpack_values(tensors, len(keys))))
        for one, value in pairs:
            request_id, var, version = parse_tensor_key(one)
            self.store.put(request_id, var, version, value)

    def _release(self, request_id: str) -> None:
        self.store.drop(request_id)
        self.params.pop(request_id, None)
        for engine in self.engines.values():
            engine.release(request_id)

    def stats(self) -> dict[str, float]:
        """Every engine's gauges, as ``"node.stat" -> value`` (they ride on each StepResult)."""
        out = {f"{node}.sessions_held": float(count) for node, count in self.sessions.held().items()}
        out |= {f"{node}.session_bytes": float(size) for node, size in self.sessions.held_bytes().items()}
        for node, engine in self.engines.items():
            for name, value in engine.stats().items():
                out[f"{node}.{name}"] = value
        return out


def _profiling() -> bool:
    """Whether a torch profiler (or ``emit_nvtx``) is recording, so a node's labelled range
    would be seen. Entering and leaving ``record_function`` goes through torch's op
    dispatcher, ~7 us a node a plan on a warm CPU (more on one the model's step left cold),
    paid while nothing records it. ``torch.profiler.profile`` (every thread's too) and
    ``emit_nvtx`` set this flag, and torch's compiled code asks it for its own ranges; a
    torch without it labels always."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def _pack(values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One message's tensors for several values: stacked along a new first dimension when
    they share shape, dtype and device (one tensor to copy and frame), else one each,
    named by position (``protocol.unpack_values`` takes them apart)."""
    first = values[0]
    if len(values) > 1 and all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device
                               for v in values):
        return {EMIT_STACKED: torch.stack(values)}
    return {str(i): value for i, value in enumerate(values)}


def _failure(err: Exception) -> BaseException:
    """What an item whose engine raised ``err`` reports (called while handling it): a
    ``RequestError`` as it is, the client's mistake found on the worker (its 4xx names the
    field); anything else as a ``RuntimeError`` with the gist of its traceback."""
    return err if isinstance(err, RequestError) else RuntimeError(_describe_error())


def _describe_error() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return lines[-1] if lines else "unknown error"
