"""Tests for the paged-KV page allocator."""

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

from mstar.engine.page_pool import OutOfPages, PagePool


# ----------------------------------------------------------------- unit tests
@pytest.mark.parametrize(
    ("num_pages", "page_size", "field"),
    [
        (0, 16, "num_pages"),
        (-1, 16, "num_pages"),
        (4, 0, "page_size"),
        (4, -3, "page_size"),
        (4.0, 16, "num_pages"),
        (4, "16", "page_size"),
        (True, 16, "num_pages"),
    ],
)
def test_constructor_rejects_bad_args(num_pages: object, page_size: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PagePool(num_pages, page_size)  # type: ignore[arg-type]


def test_fresh_pool() -> None:
    pool = PagePool(8, 4)
    assert (pool.num_pages, pool.page_size) == (8, 4)
    assert pool.num_free_pages == 8
    assert pool.num_used_pages == 0
    assert pool.seq_ids() == []
    pool.check_invariants()


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_pages_needed(tokens: int, pages: int) -> None:
    assert PagePool(8, 4).pages_needed(tokens) == pages


def test_pages_needed_rejects_negative() -> None:
    with pytest.raises(ValueError):
        PagePool(8, 4).pages_needed(-1)


def test_reserve_new_and_grow() -> None:
    pool = PagePool(8, 4)
    assert pool.reserve("a", 5) == [0, 1]
    assert pool.has("a") and pool.seq_len("a") == 5
    assert pool.page_table("a") == [0, 1]
    # growing inside the last page takes nothing new
    assert pool.reserve("a", 8) == []
    assert pool.seq_len("a") == 8
    assert pool.reserve("a", 9) == [2]
    assert pool.reserve("b", 1) == [3]
    assert pool.reserve("a", 9) == []  # same length: no-op
    assert pool.num_used_pages == 4 and pool.num_free_pages == 4
    assert pool.seq_ids() == ["a", "b"]
    pool.check_invariants()


def test_reserve_zero_tokens_creates_empty_seq() -> None:
    pool = PagePool(2, 4)
    assert pool.reserve("a", 0) == []
    assert pool.has("a") and pool.seq_len("a") == 0 and pool.page_table("a") == []
    pool.check_invariants()


def test_reserve_rejects_shrink_and_negative() -> None:
    pool = PagePool(8, 4)
    pool.reserve("a", 6)
    with pytest.raises(ValueError, match="shrink"):
        pool.reserve("a", 5)
    with pytest.raises(ValueError):
        pool.reserve("b", -1)
    with pytest.raises(ValueError, match="shrink"):
        pool.can_reserve("a", 2)
    assert not pool.has("b")
    assert pool.seq_len("a") == 6


def test_out_of_pages_leaves_state_unchanged() -> None:
    pool = PagePool(3, 4)
    pool.reserve("a", 8)
    with pytest.raises(OutOfPages):
        pool.reserve("b", 5)
    assert not pool.has("b")
    with pytest.raises(OutOfPages):
        pool.reserve("a", 13)
    assert pool.seq_len("a") == 8 and pool.page_table("a") == [0, 1]
    assert pool.num_free_pages == 1
    pool.check_invariants()


def test_grow_is_all_or_none() -> None:
    pool = PagePool(num_pages=4, page_size=4)
    pool.reserve("a", 4)
    pool.reserve("b", 3)
    assert pool.grow(["a", "b"], [5, 4])  # "a" takes a page, "b" fits its last one
    assert pool.page_table("a") == [0, 2] and pool.seq_len("b") == 4
    assert not pool.grow(["a", "b"], [9, 9])  # 3 pages wanted, 1 free: nothing changes
    assert (pool.seq_len("a"), pool.seq_len("b"), pool.num_free_pages) == (5, 4, 1)
    assert not pool.grow(["a", "c"], [6, 1])  # "c" holds no pages
    assert pool.seq_len("a") == 5
    with pytest.raises(ValueError, match="shrink"):
        pool.grow(["a"], [4])
    with pytest.raises(ValueError, match=">= 0"):
        pool.grow(["a"], [-1])
    pool.check_invariants()


def test_can_reserve() -> None:
    pool = PagePool(3, 4)
    assert pool.can_reserve("a", 12)
    assert not pool.can_reserve("a", 13)
    pool.reserve("a", 5)
    assert pool.can_reserve("a", 12)  # needs one more page; one is free
    assert not pool.can_reserve("a", 13)
    assert pool.can_reserve("b", 4)
    assert not pool.can_reserve("b", 9)
    assert pool.num_free_pages == 1  # queries take nothing


def test_free_returns_pages_and_is_idempotent() -> None:
    pool = PagePool(4, 2)
    pool.reserve("a", 3)
    pool.reserve("b", 2)
    assert pool.free("a") == 2
    assert not pool.has("a")
    assert pool.free("a") == 0
    assert pool.free("never") == 0
    assert pool.num_free_pages == 3
    # freed pages are reused once the untouched ones run out
    assert sorted(pool.reserve("c", 6)) == [0, 1, 3]
    pool.check_invariants()


def test_unknown_seq_queries_raise_key_error() -> None:
    pool = PagePool(4, 2)
    for call in (
        lambda: pool.seq_len("x"),
        lambda: pool.page_table("x"),
        lambda: pool.slot("x", 0),
        lambda: pool.slots("x", 0, 0),
    ):
        with pytest.raises(KeyError, match="x"):
            call()
    assert not pool.has("x")


def test_truncate_returns_the_tail_pages() -> None:
    pool = PagePool(6, 4)
    pool.reserve("a", 9)  # 3 pages
    table = pool.page_table("a")
    assert pool.truncate("a", 8) == 1
    assert pool.page_table("a") == table[:2] and pool.seq_len("a") == 8
    assert pool.num_free_pages == 4
    assert pool.truncate("a", 8) == 0
    assert pool.truncate("nobody", 0) == 0
    with pytest.raises(ValueError, match="up to 9"):
        pool.truncate("a", 9)
    with pytest.raises(ValueError, match="new_len"):
        pool.truncate("a", -1)
    pool.reserve("a", 9)  # grows again from the free list
    assert len(pool.page_table("a")) == 3
    pool.check_invariants()


def test_page_table_is_a_copy() -> None:
    pool = PagePool(4, 2)
    pool.reserve("a", 2)
    pool.page_table("a").append(3)
    assert pool.page_table("a") == [0]


def test_slot_and_slots() -> None:
    pool = PagePool(6, 4)
    pool.reserve("x", 4)  # takes page 0
    pool.reserve("a", 3)  # takes page 1
    pool.reserve("x", 5)  # takes page 2
    pool.reserve("a", 6)  # takes page 3
    assert pool.page_table("a") == [1, 3]
    assert [pool.slot("a", p) for p in range(6)] == [4, 5, 6, 7, 12, 13]
    assert pool.slots("a", 0, 6) == [4, 5, 6, 7, 12, 13]
    assert pool.slots("a", 2, 5) == [6, 7, 12]
    assert pool.slots("a", 3, 3) == []
    assert pool.slots("x", 0, 5) == [0, 1, 2, 3, 8]


def test_slot_errors() -> None:
    pool = PagePool(4, 4)
    pool.reserve("a", 5)  # two pages, but only five tokens
    with pytest.raises(IndexError):
        pool.slot("a", 5)
    with pytest.raises(IndexError):
        pool.slot("a", -1)
    with pytest.raises(IndexError):
        pool.slots("a", 0, 6)
    with pytest.raises(IndexError):
        pool.slots("a", -1, 2)
    with pytest.raises(ValueError):
        pool.slots("a", 3, 2)


def test_check_invariants_detects_corruption() -> None:
    def fresh() -> PagePool:
        pool = PagePool(4, 2)
        pool.reserve("a", 3)
        pool.reserve("b", 1)
        return pool

    pool = fresh()
    pool._tables["b"][0] = pool._tables["a"][0]  # held twice, counted once (and one page leaked)
    with pytest.raises(AssertionError, match="held by 2 tables, counted 1"):
        pool.check_invariants()

    pool = fresh()
    pool._free.append(pool._tables["a"][0])  # free and owned
    with pytest.raises(AssertionError, match="both free and owned"):
        pool.check_invariants()

    pool = fresh()
    pool._free.pop()  # a page leaked
    with pytest.raises(AssertionError, match="num_pages"):
        pool.check_invariants()

    pool = fresh()
    pool._lens["a"] = 5  # length needs three pages, holds two
    with pytest.raises(AssertionError, match="needs 3"):
        pool.check_invariants()

    pool = fresh()
    pool._free.append(pool._free[0])  # duplicated on the free list
    with pytest.raises(AssertionError, match="free list twice"):
        pool.check_invariants()


# ------------------------------------------------------------ property tests
class PagePoolMachine(RuleBasedStateMachine):
    """Random reserve / grow / free / preempt-and-resume against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(1, 1)
        self.lens: dict[str, int] = {}  # model of live sequences
        self.preempted: dict[str, int] = {}  # freed sequences waiting to resume
        self.next_id = 0

    @initialize(num_pages=st.integers(1, 24), page_size=st.integers(1, 8))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages, page_size)

    def _try_reserve(self, seq_id: str, new_len: int) -> None:
        pool = self.pool
        before_free = pool.num_free_pages
        before_table = pool.page_table(seq_id) if pool.has(seq_id) else None
        extra = pool.pages_needed(new_len) - len(before_table or [])
        assert pool.can_reserve(seq_id, new_len) == (extra <= before_free)
        try:
            new_pages = pool.reserve(seq_id, new_len)
        except OutOfPages:
            assert extra > before_free
            assert pool.num_free_pages == before_free
            assert (pool.page_table(seq_id) if pool.has(seq_id) else None) == before_table
            if seq_id in self.lens:
                assert pool.seq_len(seq_id) == self.lens[seq_id]
            return
        assert len(new_pages) == extra
        assert pool.page_table(seq_id) == (before_table or []) + new_pages
        assert pool.num_free_pages == before_free - extra
        self.lens[seq_id] = new_len

    @rule(length=st.integers(0, 40))
    def reserve_new(self, length: int) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        self._try_reserve(seq_id, length)

    @precondition(lambda self: self.lens)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def grow(self, data: st.DataObject, extra: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lens)))
        self._try_reserve(seq_id, self.lens[seq_id] + extra)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def grow_together(self, data: st.DataObject) -> None:
        """A decode step's rows grow at once (``grow``): all or none, as ``reserve`` row by row
        would decide when every row fits, else the pool unchanged."""
        pool = self.pool
        ids = data.draw(st.lists(st.sampled_from(sorted(self.lens)), min_size=1, unique=True))
        lens = [self.lens[seq_id] + data.draw(st.integers(0, 20)) for seq_id in ids]
        unknown = data.draw(st.booleans())
        if unknown:
            ids, lens = [*ids, "no-such-seq"], [*lens, 1]
        before = {seq_id: pool.page_table(seq_id) for seq_id in ids if pool.has(seq_id)}
        before_free = pool.num_free_pages
        extra = sum(max(0, pool.pages_needed(n) - len(before[seq_id])) for seq_id, n in zip(ids, lens)
                    if seq_id in before)
        grown = pool.grow(ids, lens)
        assert grown == (not unknown and extra <= before_free)
        if not grown:
            assert pool.num_free_pages == before_free
            assert {seq_id: pool.page_table(seq_id) for seq_id in before} == before
            return
        assert pool.num_free_pages == before_free - extra
        for seq_id, n in zip(ids, lens):
            assert pool.page_table(seq_id)[:len(before[seq_id])] == before[seq_id]
            self.lens[seq_id] = n

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lens)))
        expected = self.pool.pages_needed(self.lens.pop(seq_id))
        assert self.pool.free(seq_id) == expected
        assert not self.pool.has(seq_id)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lens)))
        self.preempted[seq_id] = self.lens.pop(seq_id)
        self.pool.free(seq_id)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.preempted)))
        self._try_reserve(seq_id, self.preempted[seq_id])
        if self.pool.has(seq_id):
            del self.preempted[seq_id]

    @precondition(lambda self: self.lens)
    @rule(data=st.data(), back=st.integers(0, 20))
    def truncate(self, data: st.DataObject, back: int) -> None:
        """A step reserved ahead and discarded: the sequence shrinks to what it holds."""
        seq_id = data.draw(st.sampled_from(sorted(self.lens)))
        new_len = max(0, self.lens[seq_id] - back)
        keep = self.pool.page_table(seq_id)[: self.pool.pages_needed(new_len)]
        before_free = self.pool.num_free_pages
        returned = self.pool.truncate(seq_id, new_len)
        assert self.pool.page_table(seq_id) == keep
        assert self.pool.num_free_pages == before_free + returned
        self.lens[seq_id] = new_len

    @rule()
    def free_unknown(self) -> None:
        assert self.pool.free("no-such-seq") == 0

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert sorted(pool.seq_ids()) == sorted(self.lens)
        for seq_id, length in self.lens.items():
            assert pool.seq_len(seq_id) == length
        used = sum(pool.pages_needed(n) for n in self.lens.values())
        assert pool.num_used_pages == used
        assert pool.num_free_pages == pool.num_pages - used

    @invariant()
    def page_tables_disjoint(self) -> None:
        seen: set[int] = set()
        for seq_id in self.pool.seq_ids():
            table = set(self.pool.page_table(seq_id))
            assert not table & seen
            seen |= table

    @invariant()
    def slots_unique(self) -> None:
        pool = self.pool
        all_slots: list[int] = []
        for seq_id, length in self.lens.items():
            row = pool.slots(seq_id, 0, length)
            assert row == [pool.slot(seq_id, p) for p in range(length)]
            all_slots.extend(row)
        assert len(set(all_slots)) == len(all_slots)
        assert all(0 <= s < pool.num_pages * pool.page_size for s in all_slots)

    def teardown(self) -> None:
        for seq_id in list(self.pool.seq_ids()):
            self.pool.free(seq_id)
        assert self.pool.num_free_pages == self.pool.num_pages
        assert self.pool.num_used_pages == 0
        self.pool.check_invariants()


PagePoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPagePoolProperties = PagePoolMachine.TestCase
