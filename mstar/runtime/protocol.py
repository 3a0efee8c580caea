"""Every message that crosses between runtime roles, as compact msgspec structs.

Two records carry the work: a ``StepPlan`` going down from the conductor to a worker and
a ``StepResult`` coming back up. Tensors never ride in these: they travel worker to worker
on the tensor transport, keyed by ``tensor_key``. A request's parameters cross to a worker
once, with its first work item there.
"""

from __future__ import annotations

from typing import Any

import msgspec


class VarRef(msgspec.Struct, frozen=True, array_like=True):
    """A version of one walk variable of one request."""

    var: str
    version: int


class ChunkRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """A stream-edge chunk: the consumer's ``port`` gets the items of ``var`` with these
    versions, concatenated; of its output it keeps items ``[keep_start, keep_end)``
    (relative to the window)."""

    port: str
    var: str
    versions: list[int]
    index: int
    keep_start: int
    keep_end: int
    last: bool = False
    drop: list[int] = []  # versions of ``var`` no later chunk reads: the rank frees them once this one ran


class SessionRef(msgspec.Struct, frozen=True, array_like=True):
    """The session a request's steps run in (``mstar.runtime.sessions``): its id, and
    whether the request continues the state kept under it (``resume``) or starts afresh."""

    id: str
    resume: bool = False


class WorkItem(msgspec.Struct, frozen=True, omit_defaults=True):
    """Run one step of one request.

    ``reads`` gives, per input port, the variable version to wait for; ``writes``, per
    output port, the variable and version to stamp; ``send`` where each output must go
    (ranks other than this one); ``emit`` the outputs that stream to the client.
    """

    request_id: str
    node: str
    op: str
    step: str
    iteration: int
    reads: dict[str, VarRef]
    writes: dict[str, VarRef]
    send: dict[str, list[int]] = {}  # output port -> destination ranks
    emit: dict[str, str] = {}  # output port -> modality
    params: dict[str, Any] | None = None  # the request's parameters, on first contact only
    chunk: ChunkRef | None = None  # set when the step consumes a stream edge
    session: SessionRef | None = None  # set when the request runs in a session


class StepPlan(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    plan_id: int
    items: list[WorkItem] = []
    release: list[str] = []  # requests whose state the worker must free now
    drop_sessions: list[str] = []  # sessions whose kept state the worker must free now (before items)


class ItemResult(msgspec.Struct, frozen=True, omit_defaults=True):
    request_id: str
    step: str
    flags: list[str] = []
    finish_reason: str | None = None
    error: str | None = None
    error_status: int | None = None  # the engine refused the request as the client's mistake (a 4xx) ...
    error_field: str | None = None  # ... naming this field of the request
    emitted: int = 0  # how many emit messages this item sent to the frontend
    silent: list[str] = []  # output ports that produced nothing this step
    # The engine did not run the step now (too few KV pages: its cache may have been freed,
    # to be recomputed); it wrote and emitted nothing, and the conductor dispatches it again.
    preempted: bool = False


class StepResult(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    rank: int
    plan_id: int
    results: list[ItemResult] = []
    profile: dict[str, float] = {}  # node -> seconds spent in this plan
    gauges: dict[str, float] = {}  # "node.stat" -> value after the plan (KV pages in use, ...)
    # session -> the bytes its kept state holds on this rank after the plan, for every session
    # whose items ran in it (the frontend's book weighs idle sessions against session_store_bytes)
    session_bytes: dict[str, int] = {}
    # a split group's leader: per follower rank, the bytes of the sessions it reported since
    # the last plan (its own shard's), and its session gauges ("node.session_bytes", ...)
    follower_session_bytes: dict[int, dict[str, int]] = {}
    follower_gauges: dict[int, dict[str, float]] = {}


class WorkerReady(msgspec.Struct, tag=True, frozen=True):
    rank: int
    tensor_address: str
    gauges: dict[str, float] = {}  # the engines' gauges before any work ("node.stat" -> value)


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    rank: int
    error: str


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """A worker is still there (sent from a thread of its own, busy or not; see ``heartbeat.py``)."""

    rank: int


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    reason: str = ""


class PeerTable(msgspec.Struct, tag=True, frozen=True):
    """Sent to every worker once all are up: how to reach each other's tensor endpoint."""

    addresses: dict[int, str]


ControlMessage = StepPlan | StepResult | WorkerReady | WorkerFailed | Heartbeat | Shutdown | PeerTable

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode(message: ControlMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> ControlMessage:
    return _decoder.decode(data)


def tensor_key(request_id: str, var: str, version: int) -> str:
    return f"{request_id}\x1f{var}\x1f{version}"


def parse_tensor_key(key: str) -> tuple[str, str, int]:
    request_id, var, version = key.split("\x1f")
    return request_id, var, int(version)


ABANDON = "\x1dabandon\x1f"  # the key prefix of an abandon notice (``abandon_key``)


def abandon_key(rank: int, request_ids: list[str]) -> str:
    """The key of the notice the frontend sends the other ranks of a deployment when rank
    ``rank`` is declared dead: the requests it failed are abandoned, and a worker waiting
    for their inputs (which that rank would have sent) stops waiting. It travels on the
    tensor transport, with no tensors: the channel such a worker listens to while it waits."""
    return ABANDON + "\x1e".join([str(rank), *request_ids])


def parse_abandon(key: str) -> tuple[int, list[str]] | None:
    """``(dead rank, request ids)`` of an abandon notice; None for any other key."""
    if not key.startswith(ABANDON):
        return None
    rank, *request_ids = key[len(ABANDON):].split("\x1e")
    return int(rank), request_ids


def emit_key(key: str, modality: str) -> str:
    """The key of an output streamed to the frontend: its tensor key and its modality."""
    return f"{key}\x1f{modality}"


EMIT_STACKED = "stacked"


def emit_batch_key(keys: list[str]) -> str:
    """One frontend message carries every output a plan streamed: its key lists their
    ``emit_key`` in order; tensor ``str(i)`` is the value of the ``i``-th or, when the values
    all have one shape and dtype (a decode step's tokens), tensor ``EMIT_STACKED`` holds
    them all along its first dimension (one tensor to copy and frame, not one per request)."""
    return "\x1e".join(keys)


def split_batch_key(key: str) -> list[str]:
    """The keys an ``emit_batch_key`` joined, in order."""
    return key.split("\x1e")


def unpack_values(tensors: dict[str, Any], count: int) -> list[Any]:
    """The ``count`` values of a batch message, in order: rows of ``EMIT_STACKED``, or the
    tensors named ``"0"``, ``"1"``, ..."""
    stacked = tensors.get(EMIT_STACKED)
    return list(stacked.unbind(0)) if stacked is not None else [tensors[str(i)] for i in range(count)]


def parse_emit_batch(key: str) -> list[tuple[str, int, str]]:
    """``(request_id, version, modality)`` of every output of an ``emit_batch_key``, in order."""
    out = []
    for one in split_batch_key(key):
        request_id, _, version, modality = one.split("\x1f")
        out.append((request_id, int(version), modality))
    return out
