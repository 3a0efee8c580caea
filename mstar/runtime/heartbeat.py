"""Heartbeats: how the server tells a worker that is busy from one that is gone.

A local worker process that dies is seen at once (its process handle says so). A rank on
another machine is not: when its node goes (the machine, its network, or the Ray raylet
that owns the actor), Ray declares the node dead only after it has missed its own health
checks, about 16 s with Ray's defaults. So each Ray rank sends a ``Heartbeat`` every
``HEARTBEAT_S`` on a control socket of its own, from a thread of its own: a step that keeps
the main thread busy for seconds (a long prefill on the GPU, a model load) does not hold
the beats back, as torch releases the GIL inside its kernels and Python hands it to other
threads every few milliseconds otherwise. The server declares a rank lost once it has
had no heartbeat from it for ``LOST_AFTER_S``.

The thread beats only while ``attached()`` holds: an actor whose raylet died is orphaned
(its parent process changes) and stops beating at once. Its process may run on, and even
send results, but Ray can no longer stop, restart or place anything for it: the server
counts only heartbeats, declares it lost, and restarts the rank elsewhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from mstar.runtime import protocol
from mstar.runtime.protocol import Heartbeat

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # how often a worker says it is there
LOST_AFTER_S = 3.0  # silence after which the server declares the rank lost (6 beats missed)


class HeartbeatSender:
    """Sends ``Heartbeat(rank)`` to ``address`` (the rank's result socket on the server)
    every ``period_s`` from a daemon thread, while ``attached()`` is true; ``close`` stops it."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, *, period_s: float = HEARTBEAT_S,
                 attached: Callable[[], bool] = lambda: True):
        self.rank, self.period_s, self.attached = rank, period_s, attached
        self._socket = ctx.socket(zmq.PUSH)  # its own: a zmq socket is not shared between threads
        self._socket.setsockopt(zmq.SNDHWM, 4)  # beats the server has not read are stale: drop them
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mstar-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = protocol.encode(Heartbeat(self.rank))
        while not self._stop.is_set():
            if not self.attached():
                log.error("worker %d: detached from its node (its raylet is gone); no more heartbeats", self.rank)
                break
            try:
                self._socket.send(beat, zmq.NOBLOCK)
            except zmq.Again:  # the server is not reading: it will decide on its own
                pass
            self._stop.wait(self.period_s)
        self._socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1)
