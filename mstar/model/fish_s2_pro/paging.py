"""Paged-attention metadata for the dual AR's eager paths (the fast AR's per-frame cache,
the reference generation loop)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata


def step_metadata(pages: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int], page_size: int,
                  device: torch.device | str = "cpu") -> PagedAttentionMetadata:
    """A step in which sequence ``b``, its KV on ``pages[b]``, writes ``counts[b]`` tokens at
    positions ``starts[b]`` onwards."""
    positions, slots, query_starts = [], [], [0]
    for table, start, count in zip(pages, starts, counts, strict=True):
        for pos in range(start, start + count):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
        query_starts.append(query_starts[-1] + count)
    seq_lens = [start + count for start, count in zip(starts, counts, strict=True)]
    width = max(len(table) for table in pages)
    page_table = [list(table) + [0] * (width - len(table)) for table in pages]

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedAttentionMetadata(positions=tensor(positions), slot_mapping=tensor(slots),
                                  query_start_loc=tensor(query_starts), seq_lens=tensor(seq_lens),
                                  page_table=tensor(page_table), page_size=page_size,
                                  host_query_start_loc=tuple(query_starts), host_seq_lens=tuple(seq_lens))
