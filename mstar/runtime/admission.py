"""Admission at submit time: a bounded wait queue in front of the conductor.

The conductor admits requests up to ``max_concurrent_requests`` (and what its resource
pools hold); the others wait. The gate caps how many may wait: a request that would make
the backlog reach past ``max_queue_size`` is refused at once (HTTP 429 with Retry-After)
rather than joining an ever longer queue.

The backlog is what the frontend handed to the runtime and the conductor has not admitted:
requests still in the loop's command queue plus the conductor's wait queue, less the free
slots they take at its next tick. The conductor's counts are read from the frontend's
thread (``len`` of its containers, atomic in CPython); the conductor itself stays pure.
Under races the count may be off by a request for an instant, never more.
"""

from __future__ import annotations

import threading

from mstar.contract import Overloaded
from mstar.runtime.conductor import Conductor

RETRY_AFTER_S = 1


class AdmissionGate:
    def __init__(self, conductor: Conductor, max_queue_size: int | None, retry_after_s: int = RETRY_AFTER_S):
        self.conductor = conductor
        self.max_queue_size = max_queue_size  # None: unbounded
        self.retry_after_s = retry_after_s
        self._handing_over = 0  # accepted, not yet in the conductor's wait queue
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Requests accepted and not admitted yet."""
        return self._handing_over + self.conductor.num_waiting

    def backlog(self) -> int:
        """Waiting requests that the next tick cannot admit for lack of a free slot."""
        return max(0, self.waiting - self._free_slots())

    def enter(self) -> None:
        """Let one more request in, or raise ``Overloaded`` if it would wait past the queue."""
        with self._lock:
            if self.max_queue_size is not None and self.waiting + 1 - self._free_slots() > self.max_queue_size:
                raise Overloaded(
                    f"the server is at capacity ({self.conductor.max_concurrent} requests running and "
                    f"{self.max_queue_size} waiting); retry later", self.retry_after_s)
            self._handing_over += 1

    def _free_slots(self) -> int:
        return max(0, self.conductor.max_concurrent - self.conductor.num_live)

    def handed_over(self) -> None:
        """The loop thread passed an entered request to the conductor (or rejected it)."""
        with self._lock:
            self._handing_over -= 1

    def withdraw(self) -> None:
        """An entered request never reached the loop thread (its submission failed)."""
        self.handed_over()
