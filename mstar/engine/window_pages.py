"""KV pages of a model with sliding-window layers: two page pools side by side.

The layers that attend to every position keep their K/V in ``full``, a ``PagePool`` like any
model's; the sliding-window layers keep theirs in ``windowed``, where each sequence gives back
the pages its window has left behind as it grows (``PagePool.release_before``), so a long
request holds ``window / page_size + 1`` or so pages there however long it runs. A page id
names one page of each pool's own caches; a sequence has a table in each.

``SlidingWindowPages`` answers the part of ``PagePool``'s interface the autoregressive engine
uses: sizes, lengths and admission are the ``full`` pool's (the conductor admits against it),
a reservation takes pages in both, ``free`` and ``truncate`` act on both. Pages are released
when a sequence reserves for its next step, which starts at the length it had reserved: that
step's first query reads keys from ``length - window + 1`` on, and no later step reads
earlier ones (steps on a device run in launch order, so a step still running reads its pages
before a later step writes them again).
"""

from __future__ import annotations

from mstar.engine.page_pool import OutOfPages, PagePool


class SlidingWindowPages:
    """``full`` and ``windowed`` pools of ``page_size`` pages; ``window``: the longest window
    of the sliding layers (positions a query sees, itself included)."""

    def __init__(self, num_pages: int, page_size: int, window: int, window_pages: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.full = PagePool(num_pages, page_size)
        self.windowed = PagePool(num_pages if window_pages is None else window_pages, page_size)
        self.window = window

    # ------------------------------------------------------------------ sizes
    @property
    def num_pages(self) -> int:
        return self.full.num_pages

    @property
    def page_size(self) -> int:
        return self.full.page_size

    @property
    def num_free_pages(self) -> int:
        return self.full.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.full.num_used_pages

    def pages_needed(self, num_tokens: int) -> int:
        return self.full.pages_needed(num_tokens)

    def pages_missing(self, seq_id: str, num_tokens: int) -> int:
        return self.full.pages_missing(seq_id, num_tokens)

    # ------------------------------------------------------------ reservation
    def _keep_from(self, seq_id: str) -> int:
        """The first position the sequence's next step may read in the windowed layers."""
        return max(0, self.full.seq_len(seq_id) - self.window + 1) if self.full.has(seq_id) else 0

    def _windowed_missing(self, seq_id: str, new_len: int) -> int:
        """Free windowed pages a reservation to ``new_len`` needs, after its release."""
        pool = self.windowed
        if not pool.has(seq_id):
            return pool.pages_needed(new_len)
        held = len(pool.page_table(seq_id))
        releasable = max(0, min(self._keep_from(seq_id) // pool.page_size, held - 1) - pool.released(seq_id))
        return max(0, pool.pages_needed(new_len) - held - releasable)

    def can_reserve(self, seq_id: str, new_len: int) -> bool:
        return (self.full.can_reserve(seq_id, new_len)
                and self._windowed_missing(seq_id, new_len) <= self.windowed.num_free_pages)

    def reserve(self, seq_id: str, new_len: int) -> list[int]:
        """Grow ``seq_id`` to ``new_len`` tokens in both pools, first releasing its windowed
        pages before its next step's window; the ``full`` pool's new pages. ``OutOfPages``
        leaves both pools as they were (but for pages released)."""
        if not self.can_reserve(seq_id, new_len):
            raise OutOfPages(f"sequence {seq_id!r} needs more pages for {new_len} tokens than are free "
                             f"({self.full.num_free_pages} full, {self.windowed.num_free_pages} windowed)")
        self.windowed.release_before(seq_id, self._keep_from(seq_id))
        pages = self.full.reserve(seq_id, new_len)
        self.windowed.reserve(seq_id, new_len)
        return pages

    def truncate(self, seq_id: str, new_len: int) -> int:
        self.windowed.truncate(seq_id, new_len)
        return self.full.truncate(seq_id, new_len)

    def free(self, seq_id: str) -> int:
        self.windowed.free(seq_id)
        return self.full.free(seq_id)

    # ---------------------------------------------------------------- queries
    def has(self, seq_id: str) -> bool:
        return self.full.has(seq_id)

    def seq_len(self, seq_id: str) -> int:
        return self.full.seq_len(seq_id)

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        """The ``full`` pool's tables (the global layers')."""
        return self.full.tables(seq_ids)

    def windowed_tables(self, seq_ids: list[str]) -> list[list[int]]:
        """The ``windowed`` pool's tables (released entries name page 0)."""
        return self.windowed.tables(seq_ids)

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        raise NotImplementedError("the K/V of a model with sliding-window layers cannot be handed off yet")

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.windowed.check_invariants()
        if set(self.full.seq_ids()) != set(self.windowed.seq_ids()):
            raise AssertionError("the full and windowed pools hold different sequences")
        for seq_id in self.full.seq_ids():
            if self.full.seq_len(seq_id) != self.windowed.seq_len(seq_id):
                raise AssertionError(f"sequence {seq_id!r} has different lengths in the two pools")
