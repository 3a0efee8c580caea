"""Sessions: named state a node keeps on its worker between one request and the next.

A world model's rollout continues from its last window, a controller streams actions to a
simulator: the state (a rolling KV cache, last frames, latents) stays where it was made,
on the worker of the node that made it, under the request's ``session_id``.

Where the bookkeeping lives:

* The **frontend's** ``SessionBook`` (one per runtime, beside the conductor) is the
  authority: which sessions exist, which has a request in flight, when each idle one
  expires, which is least recently used. It answers at submit time, before anything is
  queued: a second request on a busy session is refused (409 naming it), a resume of a
  session it does not know (never made, ended, expired, evicted, lost with a worker) is
  refused (410 naming it). Its decisions to free a session (ended, expired, evicted, lost)
  come out as session ids, which the runtime sends every live worker in the next plan's
  ``drop_sessions``, ahead of that plan's items.
* Each **worker's** ``SessionStore`` holds the state itself, per (session, node), and
  frees it when told. Its engines reach it only through the ``SessionHandle`` on an
  ``EngineItem`` (``get`` / ``put`` / ``drop``), so a family never knows of the store,
  the book or the server. A restarted worker starts with an empty store; the runtime
  forgets every session whose requests ran on that rank, so their next resume gets 410.

The book counts idle sessions against ``session_store_size`` (a busy one is never evicted)
and keeps an idle one ``session_timeout_s`` seconds after its request finished (capped at
``session_timeout_max_s``). With ``session_store_bytes`` it bounds their bytes too, per worker
rank (device memory is per device): each ``StepResult`` carries, for every session whose items
ran in the plan, the bytes its state holds on that rank now (``SessionStore.nbytes``), and when
a request finishes, the least recently used idle sessions holding bytes on a rank whose idle
sessions hold more than the budget are evicted until none does. A session that alone holds
more than the budget on a rank is not kept at all: it is evicted as its request finishes
(its outputs were delivered; its next resume gets 410), before any other is. Sizes come
while the session is busy (a request ends only once none of its steps is in flight, and its
plans' sizes are noted before their results); one noted for an idle session would apply
the budget at once. A split group's followers hold their own shard
of the session's state; each reports its own bytes to its leader (``mstar.runtime.lockstep``),
whose ``StepResult`` carries them, so the book weighs every rank of the group by its own
figure, and a session whose steps ran on a group's leader counts as having run on each of
its ranks (a restart of any, which restarts the whole group, loses it).

A session can be pinned (``/generate/ws`` pins its socket's session while the socket is
open): pinned, it is neither evicted nor expired between its requests, and the other idle
sessions are evicted first. A request that fails or is cancelled ends its session: its state
may be half-written, and resuming it would continue from that.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mstar.contract import RequestError, SessionSpec

log = logging.getLogger(__name__)


@dataclass
class _Session:
    ranks: frozenset[int]  # the ranks its requests ran on (a restart of one loses its state)
    timeout_s: float
    busy: bool = True
    ending: bool = False  # drop it when its request finishes (end_session, or lost meanwhile)
    expires_at: float | None = None  # set while idle
    held: dict[int, int] = field(default_factory=dict)  # rank -> bytes its state holds there (as last reported)


class SessionBook:
    """The frontend's record of the deployment's sessions (thread-safe: the client threads
    submit, the conductor and emit threads finish). ``now`` is passed in (monotonic seconds).
    ``store_bytes``: the most bytes idle sessions may hold on one worker rank (None: no bound)."""

    def __init__(self, store_size: int, timeout_max_s: float, store_bytes: int | None = None):
        self.store_size = store_size
        self.timeout_max_s = timeout_max_s
        self.store_bytes = store_bytes
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # idle ones least recently used first
        self._pinned: Counter[str] = Counter()  # session -> the pins on it (two sockets may name one)
        self._lock = threading.Lock()

    def begin(self, spec: SessionSpec, ranks: frozenset[int], now: float) -> list[str]:
        """A request on ``spec.session_id`` is about to be submitted: mark the session busy.
        Returns the sessions whose state must be dropped first (the old state of an id that a
        fresh, non-resuming request takes over). Raises 409 (busy) or 410 (gone)."""
        if spec.timeout_s <= 0:
            raise RequestError("session_timeout_s", f"must be more than 0, got {spec.timeout_s}")
        timeout = min(spec.timeout_s, self.timeout_max_s)
        with self._lock:
            drops = self._expire(now)
            known = self._sessions.get(spec.session_id)
            if known is not None and known.busy:
                raise RequestError("session_id", f"session {spec.session_id!r} has a request in flight; "
                                                 "send the next one when it finishes", 409)
            if spec.resume and known is None:
                raise RequestError("session_id", f"session {spec.session_id!r} is unknown, ended, expired or was "
                                                 "evicted; start it again without resume_session", 410)
            if known is not None and not spec.resume:
                drops.append(spec.session_id)  # a fresh start under a used name: the old state goes
            session = _Session(ranks, timeout)
            if known is not None and spec.resume:  # its state stays: the ranks it ran on, the bytes it holds
                session.ranks, session.held = ranks | known.ranks, dict(known.held)
            self._sessions[spec.session_id] = session
            self._sessions.move_to_end(spec.session_id)
            return drops

    def finish(self, session_id: str, *, keep: bool, now: float) -> list[str]:
        """Its request ended (``keep``: normally, and the client did not end the session).
        Returns the sessions to drop: this one unless kept (or, unpinned, alone over
        ``store_bytes`` on a rank), and the least recently used idle ones past ``store_size``
        or ``store_bytes``."""
        with self._lock:
            known = self._sessions.get(session_id)
            if known is None or not known.busy:
                return []
            if not keep or known.ending:
                del self._sessions[session_id]
                return [session_id]
            known.busy, known.expires_at = False, now + known.timeout_s
            self._sessions.move_to_end(session_id)
            if session_id not in self._pinned and self._alone_over(session_id, known):
                del self._sessions[session_id]
                return [session_id]
            drops = []
            idle = [sid for sid, s in self._sessions.items() if not s.busy]
            evictable = [sid for sid in idle if sid not in self._pinned]
            for sid in evictable[:max(0, len(idle) - self.store_size)]:
                del self._sessions[sid]
                drops.append(sid)
            return drops + self._evict_bytes()

    def note_bytes(self, session_id: str, rank: int, nbytes: int) -> list[str]:
        """Worker rank ``rank`` reports the bytes the session's state holds there now (after a
        plan that ran its items); counted against ``store_bytes`` once the session is idle.
        The runtime notes a plan's sizes before the plan's results reach the conductor, and a
        request ends only once none of its steps is in flight, so the session is still busy
        here; should a size come for an idle one all the same, the budget is applied at once,
        as ``finish`` would have (the bound does not rest on that ordering). Returns the
        sessions to drop."""
        with self._lock:
            known = self._sessions.get(session_id)
            if known is None or known.held.get(rank) == nbytes:
                return []
            known.held[rank] = nbytes
            if known.busy or self.store_bytes is None:
                return []
            if session_id not in self._pinned and self._alone_over(session_id, known):
                del self._sessions[session_id]
                return [session_id]
            return self._evict_bytes()

    def _alone_over(self, session_id: str, session: _Session) -> bool:
        """Whether the session by itself holds more than ``store_bytes`` on some rank (logged)."""
        if self.store_bytes is None or max(session.held.values(), default=0) <= self.store_bytes:
            return False
        rank, size = max(session.held.items(), key=lambda kv: kv[1])
        log.warning("session %r holds %d bytes on rank %d, more than session_store_bytes (%d) by "
                    "itself: not kept", session_id, size, rank, self.store_bytes)
        return True

    def _evict_bytes(self) -> list[str]:
        """While the idle sessions hold more than ``store_bytes`` on some rank, evict the least
        recently used unpinned idle session holding bytes there."""
        if self.store_bytes is None:
            return []
        totals: Counter[int] = Counter()
        idle = [(sid, s) for sid, s in self._sessions.items() if not s.busy]
        for _, session in idle:
            totals.update(session.held)
        drops = []
        for sid, session in idle:
            over = [rank for rank, total in totals.items() if total > self.store_bytes]
            if not over:
                break
            if sid in self._pinned or not any(session.held.get(rank) for rank in over):
                continue
            del self._sessions[sid]
            totals.subtract(session.held)
            drops.append(sid)
        return drops

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """Keep the session (once it exists) from eviction and expiry while it has a pin:
        ``pinned`` adds one, else one is taken off."""
        with self._lock:
            if pinned:
                self._pinned[session_id] += 1
            elif self._pinned[session_id] > 1:
                self._pinned[session_id] -= 1
            else:
                self._pinned.pop(session_id, None)

    def end(self, session_id: str) -> list[str]:
        """The client ends the session: dropped now if idle, when its request finishes if busy."""
        with self._lock:
            known = self._sessions.get(session_id)
            if known is None:
                return []
            if known.busy:
                known.ending = True
                return []
            del self._sessions[session_id]
            return [session_id]

    def expire(self, now: float) -> list[str]:
        """The idle sessions whose timeout ran out, forgotten; their ids to drop."""
        with self._lock:
            return self._expire(now)

    def lost_rank(self, rank: int) -> list[str]:
        """A worker rank restarted (its store is empty): every session whose requests ran
        there is gone (a busy one once its request ends). Returns the idle ones to drop on
        the other ranks."""
        with self._lock:
            drops = []
            for sid, session in list(self._sessions.items()):
                if rank in session.ranks:
                    if session.busy:
                        session.ending = True
                    else:
                        del self._sessions[sid]
                        drops.append(sid)
            return drops

    def _expire(self, now: float) -> list[str]:
        gone = [sid for sid, s in self._sessions.items() if not s.busy and s.expires_at is not None
                and now >= s.expires_at and sid not in self._pinned]
        for sid in gone:
            del self._sessions[sid]
        return gone

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def held(self, session_id: str) -> dict[int, int]:
        """The bytes the session's state holds per worker rank, as last reported (empty for a
        session the book does not know)."""
        with self._lock:
            known = self._sessions.get(session_id)
            return dict(known.held) if known is not None else {}

    @property
    def open(self) -> int:
        """Sessions kept (idle or busy)."""
        return len(self._sessions)

    @property
    def busy(self) -> int:
        """Sessions with a request in flight."""
        return sum(1 for s in list(self._sessions.values()) if s.busy)


class SessionStore:
    """A worker's kept session state: session id -> node -> whatever the node's engine put
    (tensors, a cache object). Freed only when the frontend's book says so (``drop``)."""

    def __init__(self) -> None:
        self._state: dict[str, dict[str, Any]] = {}
        self._nodes: set[str] = set()  # the nodes that ever kept state here (their gauge stays, at 0 when freed)

    def get(self, session_id: str, node: str) -> Any | None:
        return self._state.get(session_id, {}).get(node)

    def put(self, session_id: str, node: str, state: Any) -> None:
        self._state.setdefault(session_id, {})[node] = state
        self._nodes.add(node)

    def drop(self, session_id: str, node: str | None = None) -> None:
        """Free a session's state (one node's, or all of it)."""
        if node is None:
            self._state.pop(session_id, None)
            return
        nodes = self._state.get(session_id)
        if nodes is not None:
            nodes.pop(node, None)
            if not nodes:
                del self._state[session_id]

    @property
    def sessions(self) -> list[str]:
        """The sessions that hold state here."""
        return list(self._state)

    def held(self) -> dict[str, int]:
        """Per node that ever kept state here, the sessions it holds state for now."""
        counts = dict.fromkeys(self._nodes, 0)
        for nodes in self._state.values():
            for node in nodes:
                counts[node] += 1
        return counts

    def held_bytes(self) -> dict[str, int]:
        """Per node that ever kept state here, the bytes its kept state holds now (``state_bytes``)."""
        counts = dict.fromkeys(self._nodes, 0)
        for nodes in self._state.values():
            for node, state in nodes.items():
                counts[node] += state_bytes(state)
        return counts

    def nbytes(self, session_id: str) -> int:
        """The bytes one session's state holds here, over its nodes."""
        return sum(state_bytes(state) for state in self._state.get(session_id, {}).values())

    def __len__(self) -> int:
        return len(self._state)


def state_bytes(state: Any) -> int:
    """A kept state's bytes: a tensor's ``nbytes``, or the ``nbytes`` an engine's state object
    reports; 0 for other state."""
    size = getattr(state, "nbytes", 0)
    return size if isinstance(size, int) else 0


@dataclass(frozen=True)
class SessionHandle:
    """What an engine sees of its request's session (``EngineItem.session``): ``get`` the
    state this node kept (None when nothing was: a request that starts a session afresh
    finds its old state already dropped), ``put`` the state to keep for the session's next
    request, ``drop`` it. ``resume``: the request continues the session."""

    store: SessionStore
    session_id: str
    node: str
    resume: bool

    def get(self) -> Any | None:
        return self.store.get(self.session_id, self.node)

    def put(self, state: Any) -> None:
        self.store.put(self.session_id, self.node, state)

    def drop(self) -> None:
        self.store.drop(self.session_id, self.node)
