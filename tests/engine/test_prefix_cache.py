"""The page pool's prefix cache: whole pages of computed prefixes, content-addressed by a
chained key, shared by reference count, kept idle when no sequence holds them and evicted
least recently used first; never written again, never evicted while held."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mstar.engine.page_pool import OutOfPages, PagePool

PROMPT = [7, 8, 9, 10, 11, 12, 13]  # page size 2: three whole pages and one token


def _computed(pool: PagePool, seq_id: str, tokens: list[int]) -> None:
    """A sequence that ran its whole prompt: pages reserved, K/V written, pages filed."""
    pool.reserve(seq_id, len(tokens))
    pool.register(seq_id, tokens, len(tokens))


def test_a_computed_prefix_is_found_page_by_page():
    pool = PagePool(8, 2)
    _computed(pool, "a", PROMPT)
    table = pool.page_table("a")
    assert pool.num_cached_pages == 3  # the last, partial page is not filed
    assert pool.match_prefix(PROMPT) == table[:3]
    assert pool.match_prefix(PROMPT[:6]) == table[:3]
    assert pool.match_prefix(PROMPT[:5]) == table[:2]  # whole pages only
    assert pool.match_prefix(PROMPT[:1]) == []
    assert pool.match_prefix([7, 8, 9, 0, 11, 12]) == table[:1]  # stops at the first page that differs
    assert pool.match_prefix([0, 8, 9, 10]) == []
    assert pool.match_prefix([9, 10]) == []  # a page's key is its whole prefix, not its own tokens
    pool.check_invariants()


def test_attached_pages_are_shared_and_outlive_their_sequences():
    pool = PagePool(6, 2)
    _computed(pool, "a", PROMPT)
    shared = pool.match_prefix(PROMPT[:-1])
    pool.attach("b", shared)
    assert pool.seq_len("b") == 6 and pool.page_table("b") == shared
    pool.reserve("b", 8)
    assert pool.num_used_pages == 5  # a's four, and b's one of its own
    pool.check_invariants()
    pool.free("a")
    assert pool.num_used_pages == 4 and pool.num_cached_pages == 3
    pool.free("b")
    assert pool.num_used_pages == 0 and pool.num_free_pages == 6
    assert pool.match_prefix(PROMPT) == shared  # idle, still cached
    pool.check_invariants()


def test_attach_refuses_a_live_sequence_and_uncached_pages():
    pool = PagePool(6, 2)
    _computed(pool, "a", PROMPT)
    with pytest.raises(ValueError, match="already holds"):
        pool.attach("a", pool.match_prefix(PROMPT))
    with pytest.raises(ValueError, match="not in the prefix cache"):
        pool.attach("b", [pool.page_table("a")[3]])
    assert not pool.has("b")
    pool.check_invariants()


def test_eviction_takes_free_pages_first_then_the_least_recently_used_idle_tail_first():
    pool = PagePool(5, 2)
    _computed(pool, "a", [1, 2, 3, 4])  # two cached pages
    _computed(pool, "b", [5, 6, 7, 8])  # two more
    a, b = pool.page_table("a"), pool.page_table("b")
    pool.free("a")
    pool.free("b")
    assert pool.reserve("c", 2) == [4]  # the never-cached page first
    assert pool.reserve("c", 4) == [a[1]]  # then a (idle longer), its tail before its head
    assert pool.match_prefix([1, 2, 3, 4]) == a[:1]
    pool.attach("d", pool.match_prefix([5, 6, 7, 8]))  # b is held again: never evicted
    assert pool.reserve("c", 6) == [a[0]]
    with pytest.raises(OutOfPages):
        pool.reserve("c", 8)
    assert pool.page_table("d") == b and pool.match_prefix([5, 6, 7, 8]) == b
    pool.check_invariants()


def test_out_of_pages_counts_idle_cached_pages_as_available():
    pool = PagePool(4, 2)
    _computed(pool, "a", [1, 2, 3, 4, 5, 6])
    pool.free("a")
    assert pool.num_free_pages == 4 and pool.can_reserve("b", 8)
    assert len(pool.reserve("b", 8)) == 4
    assert pool.num_cached_pages == 0
    assert not pool.can_reserve("c", 1)
    with pytest.raises(OutOfPages):
        pool.reserve("c", 1)
    pool.check_invariants()


def test_a_prefix_computed_twice_at_once_is_filed_once():
    pool = PagePool(8, 2)
    _computed(pool, "a", PROMPT)
    _computed(pool, "b", PROMPT)  # admitted before a's pages were filed: its own pages
    assert pool.num_cached_pages == 3
    assert pool.match_prefix(PROMPT) == pool.page_table("a")[:3]
    pool.free("a")
    pool.reserve("c", 8)  # evicts a's idle pages
    pool.free("c")
    assert pool.match_prefix(PROMPT) == []
    b = pool.page_table("b")
    pool.register("b", PROMPT + [14], 7)  # b goes on past its private pages: nothing new is whole
    assert pool.match_prefix(PROMPT) == []
    pool.reserve("b", 8)
    pool.register("b", PROMPT + [14], 8)  # its fourth page continues b's chain
    assert pool.match_prefix(PROMPT + [14]) == [] and b[3] in pool._key_of
    pool.check_invariants()


def test_truncate_never_cuts_into_a_shared_page():
    pool = PagePool(8, 2)
    _computed(pool, "a", PROMPT)
    pool.attach("b", pool.match_prefix(PROMPT[:-1]))
    with pytest.raises(ValueError, match="shared"):
        pool.truncate("a", 3)
    assert pool.seq_len("a") == 7
    pool.truncate("a", 4)  # whole pages dropped: still cached, held by b
    assert pool.match_prefix(PROMPT) == pool.page_table("b")
    pool.free("b")
    pool.truncate("a", 3)  # a's own page, cut into: it leaves the cache
    assert pool.match_prefix(PROMPT) == pool.page_table("a")[:1]
    pool.check_invariants()


def test_register_checks_its_range():
    pool = PagePool(8, 2)
    pool.reserve("a", 4)
    with pytest.raises(ValueError, match="register 5"):
        pool.register("a", [1, 2, 3, 4, 5], 5)
    with pytest.raises(ValueError, match="register 4"):
        pool.register("a", [1, 2, 3], 4)
    assert pool.register("a", [1, 2, 3, 4], 4) == 2
    assert pool.register("a", [1, 2, 3, 4], 4) == 0
    with pytest.raises(KeyError):
        pool.register("b", [], 0)


def test_check_invariants_detects_cache_corruption():
    def fresh() -> PagePool:
        pool = PagePool(6, 2)
        _computed(pool, "a", PROMPT)
        pool.free("a")
        _computed(pool, "b", [1, 2, 3])
        return pool

    pool = fresh()
    pool._free.append(next(iter(pool._idle)))
    with pytest.raises(AssertionError, match="idle cached pages held or free"):
        pool.check_invariants()

    pool = fresh()
    page = next(iter(pool._idle))
    del pool._idle[page]  # cached, held by nobody, not evictable: a leak
    with pytest.raises(AssertionError, match="num_pages"):
        pool.check_invariants()

    pool = fresh()
    pool._page_of[b"x"] = pool.page_table("b")[1]  # one map says the partial page is cached
    with pytest.raises(AssertionError, match="maps disagree"):
        pool.check_invariants()

    pool = fresh()
    pool.attach("c", [])
    pool._tables["c"] = [pool.page_table("b")[1]]  # shared outside the cache
    pool._refs[pool.page_table("b")[1]] += 1
    pool._lens["c"] = 1
    with pytest.raises(AssertionError, match="shared but not cached"):
        pool.check_invariants()


# ------------------------------------------------------------ property tests
class PrefixCacheMachine(RuleBasedStateMachine):
    """Random prompts over a tiny alphabet (so prefixes repeat), their prefills with cache
    hits, decodes, steps reserved ahead and rolled back, preemption and frees, against a
    model of what each page's slots hold. A hit must hand out pages whose K/V are exactly
    the prompt's prefix, and be the longest such run; no slot is written while another
    sequence shares its page or while the page is cached; eviction takes only idle pages."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(1, 1)
        self.tokens: dict[str, list[int]] = {}  # live sequences: their token ids
        self.computed: dict[str, int] = {}  # how many of them have K/V in the cache
        self.content: dict[int, tuple[int, ...]] = {}  # page -> the prefix its K/V were computed for
        self.next_id = 0

    @initialize(num_pages=st.integers(1, 12), page_size=st.integers(1, 3))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages, page_size)

    def _reserve(self, seq_id: str, new_len: int) -> bool:
        pool = self.pool
        held = {p for s in pool.seq_ids() for p in pool.page_table(s)}
        available = pool.num_free_pages
        need = pool.pages_needed(new_len) - len(pool.page_table(seq_id) if pool.has(seq_id) else [])
        try:
            new_pages = pool.reserve(seq_id, new_len)
        except OutOfPages:
            assert need > available
            return False
        assert need <= available or need <= 0
        assert not set(new_pages) & held, "a page some sequence holds was handed out again"
        if any(page in self.content for page in new_pages):
            event("a written page taken again")
        for page in new_pages:
            assert page not in pool._key_of
            self.content.pop(page, None)  # evicted or never written: its old K/V are gone
        return True

    def _compute(self, seq_id: str) -> None:
        """Run the sequence's uncomputed positions: write their slots, file whole pages."""
        pool, size = self.pool, self.pool.page_size
        tokens, table = self.tokens[seq_id], pool.page_table(seq_id)
        for pos in range(self.computed[seq_id], len(tokens)):
            page = table[pos // size]
            assert pool._refs[page] == 1, f"position {pos} written into shared page {page}"
            assert page not in pool._key_of, f"position {pos} written into cached page {page}"
            self.content[page] = tuple(tokens[:pos + 1])
        self.computed[seq_id] = len(tokens)
        pool.register(seq_id, tokens, len(tokens))

    def _forget(self, seq_id: str) -> None:
        self.pool.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def prefill(self, prompt: list[int]) -> None:
        pool, size = self.pool, self.pool.page_size
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        pages = pool.match_prefix(prompt[:-1])
        for i, page in enumerate(pages):
            assert self.content.get(page) == tuple(prompt[:(i + 1) * size]), "a hit on another prefix's K/V"
        following = tuple(prompt[:(len(pages) + 1) * size])
        if len(following) == (len(pages) + 1) * size and len(following) < len(prompt):
            assert not any(self.content.get(p) == following for p in pool._key_of), "a shorter hit than cached"
        pool.attach(seq_id, pages)
        event("prefill hit" if pages else "prefill miss")
        self.tokens[seq_id], self.computed[seq_id] = list(prompt), len(pages) * size
        if not self._reserve(seq_id, len(prompt)):
            self._forget(seq_id)
            return
        self._compute(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[seq_id].append(token)
        if not self._reserve(seq_id, len(self.tokens[seq_id])):
            self._forget(seq_id)  # preempted
            return
        self._compute(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), ahead=st.integers(1, 3))
    def roll_back(self, data: st.DataObject, ahead: int) -> None:
        """Steps launched ahead, then discarded: pages past the tokens are given back."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        length = len(self.tokens[seq_id])
        if self._reserve(seq_id, length + ahead):
            self.pool.truncate(seq_id, length)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), back=st.integers(0, 6))
    def truncate(self, data: st.DataObject, back: int) -> None:
        """Shrink a sequence into its computed tokens (refused if it cuts a shared page)."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        pool, size = self.pool, self.pool.page_size
        new_len = max(0, len(self.tokens[seq_id]) - back)
        cut = pool.page_table(seq_id)[new_len // size] if new_len % size else None
        try:
            pool.truncate(seq_id, new_len)
        except ValueError:
            assert cut is not None and pool._refs[cut] > 1
            return
        del self.tokens[seq_id][new_len:]
        self.computed[seq_id] = min(self.computed[seq_id], new_len)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._forget(data.draw(st.sampled_from(sorted(self.tokens))))

    @rule(length=st.integers(1, 30))
    def pressure(self, length: int) -> None:
        """Another request takes pages (evicting idle cached ones) and leaves."""
        if self._reserve("pressure", length):
            self.pool.free("pressure")

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert sorted(pool.seq_ids()) == sorted(self.tokens)
        held = {p for s in self.tokens for p in pool.page_table(s)}
        assert pool.num_used_pages == len(held)
        for seq_id, tokens in self.tokens.items():
            assert pool.seq_len(seq_id) == len(tokens)
            table = pool.page_table(seq_id)
            lead = next((i for i, p in enumerate(table) if p not in pool._key_of), len(table))
            assert pool.match_prefix(tokens[:lead * pool.page_size]) == table[:lead]  # held: always found

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self._forget(seq_id)
        assert self.pool.num_used_pages == 0 and self.pool.num_free_pages == self.pool.num_pages
        self.pool.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestPrefixCacheProperties = PrefixCacheMachine.TestCase
