"""A torch-free allocator of recurrent-state slots.

Layers with a recurrent state (gated DeltaNet, Mamba, a transducer's decoder) keep, per
layer, one state tensor of shape ``[max_slots, *per_slot_shape]``. A live request owns
exactly one slot index into all of them, from its first step until it is released; the
engine that owns the tensors zeroes a slot when it hands it out.

The last slot is the *sink*: never handed out, it absorbs the writes of padded rows (a
CUDA-graph batch bucket wider than the live batch), so ``max_slots`` counts the sink and a
pool serves ``max_slots - 1`` requests at once. Slots come from a FIFO free list.
"""

from __future__ import annotations

from collections import deque


class OutOfSlots(Exception):
    """Raised when a request needs a slot and none is free."""


class StatePool:
    """Hands out one state slot per request; ``sink`` is reserved for padded rows."""

    def __init__(self, max_slots: int) -> None:
        if isinstance(max_slots, bool) or not isinstance(max_slots, int):
            raise ValueError(f"max_slots must be an int, got {type(max_slots).__name__}")
        if max_slots < 2:
            raise ValueError(f"max_slots must be >= 2 (one slot plus the sink), got {max_slots}")
        self.max_slots = max_slots
        self.sink = max_slots - 1
        self._free: deque[int] = deque(range(max_slots - 1))
        self._owner: dict[str, int] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """How many requests the pool can hold at once (every slot but the sink)."""
        return self.max_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    # ------------------------------------------------------------- allocation
    def allocate(self, request_id: str) -> int:
        """A fresh slot for ``request_id``; ``ValueError`` if it already holds one,
        ``OutOfSlots`` (pool unchanged) if none is free."""
        if request_id in self._owner:
            raise ValueError(f"request {request_id!r} already holds state slot {self._owner[request_id]}")
        if not self._free:
            raise OutOfSlots(f"request {request_id!r} needs a state slot; all {self.capacity} are in use")
        slot = self._owner[request_id] = self._free.popleft()
        return slot

    def free(self, request_id: str) -> int | None:
        """Return the slot of ``request_id`` to the pool (its index); unknown ids are a no-op."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    # ---------------------------------------------------------------- queries
    def has(self, request_id: str) -> bool:
        return request_id in self._owner

    def slot(self, request_id: str) -> int:
        try:
            return self._owner[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no state slot") from None

    def request_ids(self) -> list[str]:
        return list(self._owner)

    # ------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent."""
        owned = list(self._owner.values())
        if len(set(owned)) != len(owned):
            raise AssertionError("a state slot is owned twice")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a state slot is on the free list twice")
        if free & set(owned):
            raise AssertionError(f"slots both free and owned: {sorted(free & set(owned))}")
        if self.sink in free or self.sink in owned:
            raise AssertionError("the sink slot was handed out")
        if free | set(owned) != set(range(self.capacity)):
            raise AssertionError("free + owned slots are not exactly the non-sink slots")


def check_pool_holds(max_slots: int, max_concurrent_requests: int, key: str) -> None:
    """Startup check: a pool of ``max_slots`` (sink included) must hold a slot for each of
    ``max_concurrent_requests``; the ``ValueError`` names both config keys."""
    if max_slots - 1 < max_concurrent_requests:
        raise ValueError(
            f"{key} ({max_slots}, one of them the sink) cannot hold max_concurrent_requests "
            f"({max_concurrent_requests}): set {key} to at least {max_concurrent_requests + 1} "
            f"or lower max_concurrent_requests"
        )
