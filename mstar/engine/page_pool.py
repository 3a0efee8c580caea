"""A torch-free allocator of fixed-size KV-cache pages, with a prefix cache.

The KV cache is a flat array of ``num_pages * page_size`` token slots, cut into pages of
``page_size`` slots. Each live sequence holds an ordered list of pages (its *page table*);
token ``position`` of a sequence lives in slot
``page_table[position // page_size] * page_size + position % page_size``.

Sequences grow (``reserve``), give back a tail they reserved ahead but did not use
(``truncate``: a decode step launched before its sequence was known to continue), or are
released whole (``free``); preemption is a ``free`` followed, later, by a fresh
``reserve``. Pages are handed out from a FIFO free list.

Sliding windows. A sequence whose attention reads only its last positions (the pool of a
model's sliding-window layers) gives back the pages wholly before them while it runs
(``release_before``): they are let go as ``free`` would, and the head of its table becomes a
run of released entries, which keep the positions of the pages after them and name page 0
(a page table is read as it is, and the attention masks those positions). Released entries
are never written, cut into or registered again.

Prefix cache. Once the K/V of a sequence's first ``k`` whole pages are written, ``register``
files each of those pages under the content key of the tokens up to its end: a chained hash,
``key(page i) = H(key(page i-1) + token ids of page i)``, so a key names the whole prefix, not
one page's tokens. ``match_prefix`` walks a new prompt's whole pages through those keys and
returns the longest run of cached pages; ``attach`` puts them at the head of a new sequence's
table. A page counts the sequences whose tables hold it (its reference count); when the last
one lets go, a cached page is not freed but kept, idle, in least-recently-used order, where a
later prompt may still find it. ``reserve`` takes never-cached free pages first, then evicts
idle cached pages, oldest first; a page some sequence holds is never evicted, and
``OutOfPages`` means free and idle pages together cannot cover the need. Only whole pages are
shared, and nothing is written into them again: a sequence only ever appends past its
attached pages, and ``truncate`` refuses to cut into a page another sequence shares.

The hash is BLAKE2b with a 128-bit digest over the token ids as 64-bit integers: the same on
every process and rank (tensor-parallel ranks make the same decisions), and collisions, which
would hand a request another prompt's K/V, are out of reach.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

_ROOT = b""  # the key of the empty prefix


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    """The content key of a page holding ``tokens`` after the prefix keyed ``parent``."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class OutOfPages(Exception):
    """Raised when a reservation needs more pages than are free or idle in the cache."""


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_length(name: str, value: object) -> int:
    if type(value) is int and value >= 0:  # the common case, asked several times per row and step
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class PagePool:
    """Hands out KV-cache pages to sequences, maps token positions to slots, and keeps the
    pages of computed prefixes for later prompts that start the same way."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages: int = _check_positive_int("num_pages", num_pages)
        self.page_size: int = _check_positive_int("page_size", page_size)
        self._free: deque[int] = deque(range(num_pages))  # never cached, held by no sequence
        self._tables: dict[str, list[int]] = {}
        self._lens: dict[str, int] = {}
        self._refs: list[int] = [0] * num_pages  # how many page tables hold each page
        self._page_of: dict[bytes, int] = {}  # content key -> the cached page holding that prefix
        self._key_of: dict[int, bytes] = {}  # cached page -> its content key
        # Cached pages no sequence holds, least recently used first: evicted in this order.
        self._idle: OrderedDict[int, None] = OrderedDict()
        # Per sequence, the content keys of its first whole pages as far as ``register`` (or
        # ``attach``) went: the chain the next page's key continues.
        self._chains: dict[str, list[bytes]] = {}
        # Per sequence, how many entries at the head of its table were released
        # (``release_before``): they hold no page (page 0 stands in) and count no reference.
        self._released: dict[str, int] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_pages(self) -> int:
        """Pages a reservation may take: never-cached free pages and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used_pages(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages filed in the prefix cache, held or idle."""
        return len(self._key_of)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages required to hold ``num_tokens`` tokens (ceiling division)."""
        _check_length("num_tokens", num_tokens)
        return -(-num_tokens // self.page_size)

    def pages_missing(self, seq_id: str, num_tokens: int) -> int:
        """Pages ``seq_id`` lacks to hold ``num_tokens`` tokens (all of them for an unknown id,
        none if it holds as many already)."""
        return max(0, self.pages_needed(num_tokens) - len(self._tables.get(seq_id, ())))

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
        return self._extra_pages(seq_id, new_len) <= self.num_free_pages

    def reserve(self, seq_id: str, new_len: int) -> list[int]:
        """Grow ``seq_id`` (creating it if new) to hold ``new_len`` tokens.

        Returns the page ids newly appended to its page table (possibly none): free pages
        first, then idle cached pages, least recently used first, evicted from the cache.
        Raises ``OutOfPages``, with the pool unchanged, if free and idle pages are too few.
        """
        extra = self._extra_pages(seq_id, new_len)
        if extra > self.num_free_pages:
            raise OutOfPages(
                f"sequence {seq_id!r} needs {extra} more pages for {new_len} tokens, "
                f"only {self.num_free_pages} free"
            )
        table = self._tables.setdefault(seq_id, [])
        self._lens[seq_id] = new_len
        if extra <= 0:  # the common case of a decode step: its token fits the last page
            return []
        new_pages = [self._take() for _ in range(extra)]
        table.extend(new_pages)
        return new_pages

    def grow(self, seq_ids: list[str], new_lens: list[int]) -> bool:
        """``reserve`` for a whole step's rows at once, all or none: grow each of ``seq_ids``,
        sequences the pool holds, to its ``new_lens`` tokens, with one check of the free pages
        for all of them (a decode step of 64 rows asked ``reserve`` 64 times, each validating
        and counting free pages again, ~a fifth of the engine's host work per row). Returns
        False, with the pool unchanged, when one of them holds no pages or free and idle
        pages cannot cover them together; invalid or shrinking lengths raise ``ValueError``
        as in ``reserve``."""
        tables, lens, size = self._tables, self._lens, self.page_size
        extra = 0
        for seq_id, new_len in zip(seq_ids, new_lens, strict=True):
            table = tables.get(seq_id)
            if table is None:
                return False
            if type(new_len) is not int:
                _check_length("new_len", new_len)
            if new_len < lens[seq_id]:
                _check_length("new_len", new_len)
                raise ValueError(f"cannot shrink sequence {seq_id!r} from {lens[seq_id]} to {new_len} tokens")
            missing = -(-new_len // size) - len(table)
            if missing > 0:
                extra += missing
        if extra > len(self._free) + len(self._idle):
            return False
        for seq_id, new_len in zip(seq_ids, new_lens):
            lens[seq_id] = new_len
            table = tables[seq_id]
            missing = -(-new_len // size) - len(table)
            if missing > 0:
                table.extend(self._take() for _ in range(missing))
        return True

    def _take(self) -> int:
        """A page for a table: a free one, else the least recently used idle cached one."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def _let_go(self, pages: list[int]) -> None:
        """One table lets go of ``pages`` (in table order): a page no table holds any more
        goes back to the free list, or, if cached, to the idle end of the cache, the table's
        tail before its head (a chain's head serves more prompts: it is evicted last)."""
        idle = []
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    idle.append(page)
                else:
                    self._free.append(page)
        for page in reversed(idle):
            self._idle[page] = None

    def truncate(self, seq_id: str, new_len: int) -> int:
        """Shrink ``seq_id`` to ``new_len`` tokens, letting go of the pages past them (to the
        free list, or idle in the cache); returns how many. Unknown ids are a no-op; growing is
        ``reserve``'s job. A cached page cut into (its tail to be written again) leaves the
        cache; ``ValueError`` if another sequence shares it."""
        _check_length("new_len", new_len)
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        if new_len > self._lens[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id!r} from {self._lens[seq_id]} up to {new_len} tokens")
        keep = self.pages_needed(new_len)
        if keep < self._released.get(seq_id, 0):
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {new_len} tokens: its pages before "
                             f"{self._released[seq_id] * self.page_size} were released")
        chain = self._chains.get(seq_id, [])
        whole = new_len // self.page_size
        if whole < len(chain) and whole < keep:  # the last page kept was whole: it is cut into
            cut = table[whole]
            if self._refs[cut] > 1:
                raise ValueError(f"cannot truncate sequence {seq_id!r} to {new_len} tokens: page {cut} "
                                 "is shared with another sequence")
            if cut in self._key_of:  # its slots will be written again: it leaves the cache
                del self._page_of[self._key_of.pop(cut)]
        del chain[whole:]
        dropped = table[keep:]
        del table[keep:]
        self._lens[seq_id] = new_len
        self._let_go(dropped)
        return len(dropped)

    def free(self, seq_id: str) -> int:
        """Release every page of ``seq_id``; returns how many. Unknown ids are a no-op. Its
        cached pages stay in the cache."""
        pages = self._tables.pop(seq_id, None)
        if pages is None:
            return 0
        del self._lens[seq_id]
        self._chains.pop(seq_id, None)
        held = pages[self._released.pop(seq_id, 0):]
        self._let_go(held)
        return len(held)

    def release_before(self, seq_id: str, position: int) -> int:
        """Let go of the pages of ``seq_id`` that hold only positions before ``position`` (a
        sliding window that no longer reaches them), as ``free`` would; returns how many were
        let go now. The sequence keeps its length and the places of its other pages. Unknown
        ids are a no-op."""
        _check_length("position", position)
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        done = self._released.get(seq_id, 0)
        upto = min(position // self.page_size, len(table) - 1 if table else 0)
        if upto <= done:
            return 0
        dropped = table[done:upto]
        table[done:upto] = [0] * (upto - done)
        self._released[seq_id] = upto
        self._let_go(dropped)
        return len(dropped)

    def released(self, seq_id: str) -> int:
        """How many pages at the head of ``seq_id``'s table were released (0 if unknown)."""
        return self._released.get(seq_id, 0)

    # ---------------------------------------------------------- prefix cache
    def match_prefix(self, tokens: list[int]) -> list[int]:
        """The cached pages holding the longest prefix of ``tokens`` made of whole pages, in
        order (possibly none). A query: nothing is held or reordered until ``attach``."""
        size = self.page_size
        key, pages = _ROOT, []
        for start in range(0, len(tokens) - size + 1, size):
            key = _chain(key, tokens[start:start + size])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def attach(self, seq_id: str, pages: list[int]) -> None:
        """Start the new sequence ``seq_id`` on ``pages``, cached pages from ``match_prefix``
        (a chain from the empty prefix), holding ``len(pages) * page_size`` tokens; it grows
        past them with ``reserve``. Each page is held once more (an idle one leaves the
        eviction order)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        chain = [self._key_of.get(page) for page in pages]
        if None in chain:
            raise ValueError(f"sequence {seq_id!r}: page {pages[chain.index(None)]} is not in the prefix cache")
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)
        self._tables[seq_id] = list(pages)
        self._lens[seq_id] = len(pages) * self.page_size
        self._chains[seq_id] = chain

    def register(self, seq_id: str, tokens: list[int], computed: int) -> int:
        """File the whole pages of ``seq_id`` among its first ``computed`` positions, whose K/V
        are written (``tokens``: the sequence's token ids, at least ``computed`` of them), in
        the prefix cache; returns how many pages were newly cached. Pages filed before are
        skipped; a page whose prefix another page already holds (two sequences computed the
        same prompt at once) stays private, and its sequence's chain goes on past it."""
        table = self._tables.get(seq_id) or self._table(seq_id)
        if not 0 <= computed <= min(len(tokens), self._lens[seq_id]):
            raise ValueError(f"cannot register {computed} positions of sequence {seq_id!r} of "
                             f"{self._lens[seq_id]} tokens ({len(tokens)} given)")
        chain = self._chains.setdefault(seq_id, [])
        if computed // self.page_size <= len(chain):
            return 0  # no page filled up since the last call: most decode steps
        if len(chain) < self._released.get(seq_id, 0):
            raise ValueError(f"cannot register released pages of sequence {seq_id!r}")
        size, added = self.page_size, 0
        for index in range(len(chain), computed // size):
            key = _chain(chain[-1] if chain else _ROOT, tokens[index * size:(index + 1) * size])
            chain.append(key)
            if key not in self._page_of:
                self._page_of[key] = table[index]
                self._key_of[table[index]] = key
                added += 1
        return added

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
        if page < self._released.get(seq_id, 0):
            raise IndexError(f"position {position} of sequence {seq_id!r} is on a released page")
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
        if start < end and start // size < self._released.get(seq_id, 0):
            raise IndexError(f"position {start} of sequence {seq_id!r} is on a released page")
        return [table[p // size] * size + p % size for p in range(start, end)]

    # ------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent: every page is
        exactly one of free, idle (cached, held by no table) or held; a page's reference count
        is the number of tables holding it; only cached pages are shared; the cache's two maps
        agree, and each sequence's chain names its cached pages."""
        if set(self._lens) != set(self._tables):
            raise AssertionError("sequence lengths and page tables disagree on live ids")
        if not set(self._released) <= set(self._tables):
            raise AssertionError("released pages counted for a dead sequence")
        holders = [0] * self.num_pages
        for seq_id, full in self._tables.items():
            released = self._released.get(seq_id, 0)
            if not 0 <= released < max(len(full), 1) or any(full[:released]):
                raise AssertionError(f"sequence {seq_id!r}: released entries {full[:released]} of {len(full)}")
            table = full[released:]
            stray = [p for p in table if not 0 <= p < self.num_pages]
            if stray:
                raise AssertionError(f"page ids out of range: {sorted(stray)}")
            if len(set(table)) != len(table):
                raise AssertionError(f"sequence {seq_id!r} holds a page twice")
            want = self.pages_needed(self._lens[seq_id])
            if len(full) != want:
                raise AssertionError(
                    f"sequence {seq_id!r} of {self._lens[seq_id]} tokens holds "
                    f"{len(full)} pages, needs {want}"
                )
            for page in table:
                holders[page] += 1
        if holders != self._refs:
            wrong = [p for p in range(self.num_pages) if holders[p] != self._refs[p]]
            raise AssertionError(f"page {wrong[0]} is held by {holders[wrong[0]]} tables, "
                                 f"counted {self._refs[wrong[0]]}")
        held = {p for p in range(self.num_pages) if holders[p]}
        shared = {p for p in held if holders[p] > 1} - set(self._key_of)
        if shared:
            raise AssertionError(f"pages shared but not cached: {sorted(shared)}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        idle = set(self._idle)
        stray = [p for p in free | idle if not 0 <= p < self.num_pages]
        if stray:
            raise AssertionError(f"page ids out of range: {sorted(stray)}")
        both = free & held
        if both:
            raise AssertionError(f"pages both free and owned: {sorted(both)}")
        if idle & held or idle & free:
            raise AssertionError(f"idle cached pages held or free: {sorted(idle & (held | free))}")
        if len(free) + len(idle) + len(held) != self.num_pages:
            raise AssertionError(
                f"free ({len(free)}) + idle ({len(idle)}) + owned ({len(held)}) != num_pages ({self.num_pages})"
            )
        if free & set(self._key_of) or idle != set(self._key_of) - held:
            raise AssertionError("the cached pages are not exactly the idle ones and some held ones")
        if {page: key for key, page in self._page_of.items()} != self._key_of:
            raise AssertionError("the prefix cache's key and page maps disagree")
        for seq_id, chain in self._chains.items():
            table = self._tables.get(seq_id)
            if table is None:
                raise AssertionError(f"a chain of keys for the dead sequence {seq_id!r}")
            if len(chain) > self._lens[seq_id] // self.page_size:
                raise AssertionError(f"sequence {seq_id!r} chains {len(chain)} keys, more than its whole pages")
        for seq_id, table in self._tables.items():
            chain = self._chains.get(seq_id, [])
            for index, page in enumerate(table):
                if index < self._released.get(seq_id, 0):
                    continue
                key = self._key_of.get(page)
                if key is not None and (index >= len(chain) or chain[index] != key):
                    raise AssertionError(f"sequence {seq_id!r} holds cached page {page} at {index} "
                                         "out of its chain")
