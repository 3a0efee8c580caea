"""Tests for the recurrent-state slot pool."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar.engine.state_pool import OutOfSlots, StatePool, check_pool_holds


@pytest.mark.parametrize("max_slots", [0, 1, -3, 2.0, "4", True])
def test_constructor_rejects_bad_sizes(max_slots: object) -> None:
    with pytest.raises(ValueError, match="max_slots"):
        StatePool(max_slots)  # type: ignore[arg-type]


def test_sink_is_last_and_never_handed_out() -> None:
    pool = StatePool(4)
    assert (pool.sink, pool.capacity, pool.num_free, pool.num_used) == (3, 3, 3, 0)
    slots = [pool.allocate(r) for r in ("a", "b", "c")]
    assert slots == [0, 1, 2] and pool.sink not in slots
    assert pool.num_free == 0 and pool.num_used == 3
    pool.check_invariants()


def test_allocate_free_reuse() -> None:
    pool = StatePool(3)
    assert pool.allocate("a") == 0 and pool.allocate("b") == 1
    assert pool.slot("a") == 0 and pool.has("b") and pool.request_ids() == ["a", "b"]
    assert pool.free("a") == 0
    assert not pool.has("a") and pool.free("a") is None  # freeing twice is a no-op
    assert pool.allocate("c") == 0
    pool.check_invariants()


def test_exhaustion_leaves_pool_unchanged() -> None:
    pool = StatePool(2)
    pool.allocate("a")
    with pytest.raises(OutOfSlots, match="'b'"):
        pool.allocate("b")
    assert not pool.has("b") and pool.num_used == 1
    pool.free("a")
    assert pool.allocate("b") == 0
    pool.check_invariants()


def test_double_allocation_and_unknown_slot() -> None:
    pool = StatePool(3)
    pool.allocate("a")
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a")
    with pytest.raises(KeyError, match="'z'"):
        pool.slot("z")


def test_invariants_catch_corruption() -> None:
    pool = StatePool(3)
    pool.allocate("a")
    pool._free.append(0)  # a slot both owned and free
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_startup_check_names_both_keys() -> None:
    check_pool_holds(5, 4, "resources.gdn_state.max_slots")
    with pytest.raises(ValueError, match=r"resources\.gdn_state\.max_slots \(4.*max_concurrent_requests \(4\)"):
        check_pool_holds(4, 4, "resources.gdn_state.max_slots")


class StatePoolMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a plain model of who holds a slot."""

    @initialize(max_slots=st.integers(2, 6))
    def setup(self, max_slots: int) -> None:
        self.pool = StatePool(max_slots)
        self.held: dict[str, int] = {}
        self.next_id = 0

    @rule()
    def allocate(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if len(self.held) == self.pool.capacity:
            with pytest.raises(OutOfSlots):
                self.pool.allocate(rid)
            return
        slot = self.pool.allocate(rid)
        assert slot not in self.held.values() and slot != self.pool.sink
        self.held[rid] = slot

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.held)))
        assert self.pool.free(rid) == self.held.pop(rid)

    @rule()
    def free_unknown(self) -> None:
        assert self.pool.free("nobody") is None

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.num_used == len(self.held)
        assert self.pool.num_free == self.pool.capacity - len(self.held)
        assert {r: self.pool.slot(r) for r in self.held} == self.held


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
