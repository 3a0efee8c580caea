"""Data-parallel replicas: N copies of one deployment's placement behind one front.

Each replica is a whole ``Runtime`` (its conductor, its worker ranks, their pages and
slots); nothing is shared between them but the caller's request ids. ``Replicas`` looks
like a ``Runtime`` to the backends: ``submit`` sends each new request to the healthy
replica with the fewest open requests (ties to the lowest index), and a request stays on
its replica until it ends. A replica whose rank died (or is restarting) takes no new
requests; its open ones fail there (503 naming the rank), the others keep serving.
A replica that has used up its restarts (``--max-worker-restarts``) stays out of rotation,
unhealthy, while the others serve; the server stops only when every replica has.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from mstar.contract import RequestError, SessionSpec
from mstar.model.spec import OutputStream, WalkRequest
from mstar.runtime.runtime import Runtime, Sink

log = logging.getLogger(__name__)


class Replicas:
    def __init__(self, replicas: list[Runtime]):
        assert replicas, "at least one replica"
        self.replicas = replicas
        self.routed = [0] * len(replicas)  # requests each replica was given, for /metrics
        self.retired: set[int] = set()  # replicas out of rotation for good (no restarts left)
        self._on_give_up: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    @property
    def conductor(self):
        """The first replica's conductor: every replica has the same capacity and routes."""
        return self.replicas[0].conductor

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.replicas)

    @property
    def failure(self) -> str | None:
        failures = [f"replica {i}: {r.failure}" for i, r in enumerate(self.replicas) if not r.healthy]
        return "; ".join(failures) or None

    def health(self) -> list[dict]:
        """Each replica's state, for /health."""
        return [{"replica": i, "healthy": r.healthy, "open_requests": len(r.tracked)}
                | ({} if r.healthy else {"failure": r.failure}) for i, r in enumerate(self.replicas)]

    def submit(self, request_id: str, request: WalkRequest, stream: OutputStream, sink: Sink,
               timeout_s: float | None = None, session: SessionSpec | None = None) -> None:
        """A request of a session the replicas know goes to the one keeping that session."""
        with self._lock:
            if self._holder(request_id) is not None:
                raise RequestError("request_id", f"request id {request_id!r} is already in use", 409)
            healthy = [i for i, r in enumerate(self.replicas) if r.healthy]
            if not healthy:
                raise RequestError("model", f"the server is unhealthy: {self.failure}", 503)
            index = min(healthy, key=lambda i: (len(self.replicas[i].tracked), i))
            keeper = next((i for i, r in enumerate(self.replicas) if session is not None
                           and session.session_id in r.sessions), None)
            index = keeper if keeper is not None else index
            self.routed[index] += 1
            # submitted under the lock: the next choice sees this request as open
            self.replicas[index].submit(request_id, request, stream, sink, timeout_s, session)

    def pin_session(self, session_id: str, pinned: bool = True) -> None:
        for r in self.replicas:
            r.pin_session(session_id, pinned)

    def end_session(self, session_id: str) -> None:
        for r in self.replicas:
            r.end_session(session_id)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        index = self._holder(request_id)
        if index is not None:
            self.replicas[index].cancel(request_id, reason)

    def _holder(self, request_id: str) -> int | None:
        for i, r in enumerate(self.replicas):
            with r._ids_lock:
                if request_id in r._ids:
                    return i
        return None

    def gauges(self) -> dict[str, float]:
        """Each replica's gauges under ``replica<i>.`` (``/metrics`` labels them
        ``replica="i"``), and the requests each was given."""
        out: dict[str, float] = {}
        for i, r in enumerate(self.replicas):
            out.update({f"replica{i}.{name}": value for name, value in r.gauges().items()})
            out[f"replica{i}.requests_routed"] = float(self.routed[i])
            out[f"replica{i}.replica_healthy"] = float(r.healthy)
        return out

    def supervise(self, max_restarts: int, on_give_up: Callable[[str], None] | None = None) -> None:
        """Each replica restarts its own ranks; one that gives up is retired (out of
        rotation), and ``on_give_up`` (stop the server) runs once every replica is."""
        self._on_give_up = on_give_up
        for i, r in enumerate(self.replicas):
            r.supervise(max_restarts, functools.partial(self._retire, i), outcome=f"replica {i} is out of rotation")

    def _retire(self, index: int, reason: str) -> None:
        """Replica ``index`` gave up (called on its conductor thread)."""
        with self._lock:
            self.retired.add(index)
            every = len(self.retired) == len(self.replicas)
        log.error("replica %d is out of rotation: %s", index, reason)
        if every and self._on_give_up is not None:
            self._on_give_up(f"every replica is out of rotation; the last: {reason}")

    def close(self) -> None:
        for r in self.replicas:
            r.close()
