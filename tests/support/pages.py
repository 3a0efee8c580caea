"""A test-only page allocator for paged-attention parity tests: shuffled free pages, one page
list per sequence, and the ``PagedAttentionMetadata`` of each step."""

from __future__ import annotations

import random

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata


class Pages:
    def __init__(self, num_pages: int, page_size: int, seed: int = 0) -> None:
        self.page_size = page_size
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, int]]) -> PagedAttentionMetadata:
        """The metadata of a step that adds ``n`` tokens to each ``(sequence, n)``."""
        size = self.page_size
        positions, slots, starts, seq_lens = [], [], [0], []
        for seq, n in chunks:
            pages = self.pages.setdefault(seq, [])
            old = self.lens.get(seq, 0)
            new = self.lens[seq] = old + n
            while len(pages) * size < new:
                pages.append(self.free.pop())
            for p in range(old, new):
                positions.append(p)
                slots.append(pages[p // size] * size + p % size)
            starts.append(starts[-1] + n)
            seq_lens.append(new)
        width = max(len(self.pages[seq]) for seq, _ in chunks)
        table = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in chunks]
        return PagedAttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                                      query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens),
                                      page_table=torch.tensor(table), page_size=size)
