"""A torch-free allocator of fixed-size KV-cache pages.

The KV cache is a flat array of ``num_pages * page_size`` token slots, cut into pages of
``page_size`` slots. Each live sequence owns an ordered list of pages (its *page table*);
token ``position`` of a sequence lives in slot
``page_table[position // page_size] * page_size + position % page_size``.

Sequences grow (``reserve``), give back a tail they reserved ahead but did not use
(``truncate``: a decode step launched before its sequence was known to continue), or are
released whole (``free``); preemption is a ``free`` followed, later, by a fresh
``reserve``. Pages are handed out from a FIFO free list.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    """Raised when a reservation needs more pages than are free."""


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_length(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class PagePool:
    """Hands out KV-cache pages to sequences and maps token positions to slots."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages: int = _check_positive_int("num_pages", num_pages)
        self.page_size: int = _check_positive_int("page_size", page_size)
        self._free: deque[int] = deque(range(num_pages))
        self._tables: dict[str, list[int]] = {}
        self._lens: dict[str, int] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages required to hold ``num_tokens`` tokens (ceiling division)."""
        _check_length("num_tokens", num_tokens)
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------ reservation
    def _extra_pages(self, seq_id: str, new_len: int) -> int:
        """Validate a growth request and return how many new pages it needs."""
        _check_length("new_len", new_len)
        cur_len = self._lens.get(seq_id, 0)
        if new_len < cur_len:
            raise ValueError(
                f"cannot shrink sequence {seq_id!r} from {cur_len} to {new_len} tokens"
            )
        return self.pages_needed(new_len) - len(self._tables.get(seq_id, ()))

    def can_reserve(self, seq_id: str, new_len: int) -> bool:
        """Whether ``reserve(seq_id, new_len)`` would succeed now.

        Invalid requests (negative or shrinking ``new_len``) raise ``ValueError``, as in
        ``reserve``.
        """
        return self._extra_pages(seq_id, new_len) <= len(self._free)

    def reserve(self, seq_id: str, new_len: int) -> list[int]:
        """Grow ``seq_id`` (creating it if new) to hold ``new_len`` tokens.

        Returns the page ids newly appended to its page table (possibly none). Raises
        ``OutOfPages``, with the pool unchanged, if too few pages are free.
        """
        extra = self._extra_pages(seq_id, new_len)
        if extra > len(self._free):
            raise OutOfPages(
                f"sequence {seq_id!r} needs {extra} more pages for {new_len} tokens, "
                f"only {len(self._free)} free"
            )
        table = self._tables.setdefault(seq_id, [])
        self._lens[seq_id] = new_len
        if extra <= 0:  # the common case of a decode step: its token fits the last page
            return []
        new_pages = [self._free.popleft() for _ in range(extra)]
        table.extend(new_pages)
        return new_pages

    def truncate(self, seq_id: str, new_len: int) -> int:
        """Shrink ``seq_id`` to ``new_len`` tokens, returning the pages past them to the free
        list; returns how many. Unknown ids are a no-op; growing is ``reserve``'s job."""
        _check_length("new_len", new_len)
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        if new_len > self._lens[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id!r} from {self._lens[seq_id]} up to {new_len} tokens")
        keep = self.pages_needed(new_len)
        dropped = table[keep:]
        del table[keep:]
        self._lens[seq_id] = new_len
        self._free.extend(dropped)
        return len(dropped)

    def free(self, seq_id: str) -> int:
        """Release every page of ``seq_id``; returns how many. Unknown ids are a no-op."""
        pages = self._tables.pop(seq_id, None)
        if pages is None:
            return 0
        del self._lens[seq_id]
        self._free.extend(pages)
        return len(pages)

    # ---------------------------------------------------------------- queries
    def _table(self, seq_id: str) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id: str) -> int:
        """Tokens reserved for ``seq_id`` (``KeyError`` if unknown)."""
        self._table(seq_id)
        return self._lens[seq_id]

    def page_table(self, seq_id: str) -> list[int]:
        """A copy of the ordered page ids of ``seq_id`` (``KeyError`` if unknown)."""
        return list(self._table(seq_id))

    def tables(self, seq_ids: list[str]) -> list[list[int]]:
        """The page tables of ``seq_ids`` themselves, not copies (one batch step's metadata
        reads every live sequence's table): read them, never change them."""
        try:
            return [self._tables[seq_id] for seq_id in seq_ids]
        except KeyError as err:
            raise KeyError(f"unknown sequence {err.args[0]!r}") from None

    def seq_ids(self) -> list[str]:
        return list(self._tables)

    def slot(self, seq_id: str, position: int) -> int:
        """Flat cache slot of token ``position`` of ``seq_id``."""
        table = self._table(seq_id)
        if not 0 <= position < self._lens[seq_id]:
            raise IndexError(
                f"position {position} out of range for sequence {seq_id!r} "
                f"of length {self._lens[seq_id]}"
            )
        page, offset = divmod(position, self.page_size)
        return table[page] * self.page_size + offset

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``start <= p < end`` of ``seq_id``."""
        table = self._table(seq_id)
        length = self._lens[seq_id]
        if start > end:
            raise ValueError(f"start ({start}) > end ({end})")
        if start < 0 or end > length:
            raise IndexError(
                f"range [{start}, {end}) out of range for sequence {seq_id!r} of length {length}"
            )
        size = self.page_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    # ------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent."""
        owned: set[int] = set()
        for seq_id, table in self._tables.items():
            for page in table:
                if page in owned:
                    raise AssertionError(f"page {page} owned twice (again by {seq_id!r})")
                owned.add(page)
            want = self.pages_needed(self._lens[seq_id])
            if len(table) != want:
                raise AssertionError(
                    f"sequence {seq_id!r} of {self._lens[seq_id]} tokens holds "
                    f"{len(table)} pages, needs {want}"
                )
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        both = free & owned
        if both:
            raise AssertionError(f"pages both free and owned: {sorted(both)}")
        if len(free) + len(owned) != self.num_pages:
            raise AssertionError(
                f"free ({len(free)}) + owned ({len(owned)}) != num_pages ({self.num_pages})"
            )
        stray = [p for p in free | owned if not 0 <= p < self.num_pages]
        if stray:
            raise AssertionError(f"page ids out of range: {sorted(stray)}")
        if set(self._lens) != set(self._tables):
            raise AssertionError("sequence lengths and page tables disagree on live ids")
