"""The torch paged-attention backend's decode path (every sequence one new token: one batched
computation) against plain attention over each sequence's gathered cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.attention import torch_paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata, write_kv_cache, write_kv_cache_whole


def decode_step(lengths: list[int], heads: int, kv_heads: int, dim: int = 16, page: int = 4, seed: int = 0):
    """Random q/k/v of one decode step (sequence ``b`` ends at ``lengths[b]``), a random cache
    (stale values everywhere) and shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page) for n in lengths) + 3
    free = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(len(lengths), max(-(-n // page) for n in lengths) + 1, dtype=torch.int64)
    slots = []
    for b, n in enumerate(lengths):
        pages = [free.pop() for _ in range(-(-n // page))]
        table[b, :len(pages)] = torch.tensor(pages)
        slots.append(pages[(n - 1) // page] * page + (n - 1) % page)
    batch = len(lengths)
    meta = PagedAttentionMetadata(torch.tensor(lengths) - 1, torch.tensor(slots), torch.arange(batch + 1),
                                  torch.tensor(lengths), table, page)
    q = torch.randn(batch, heads, dim, generator=gen)
    k, v = torch.randn(batch, kv_heads, dim, generator=gen), torch.randn(batch, kv_heads, dim, generator=gen)
    cache = torch.randn(2, num_pages, page, kv_heads, dim, generator=gen)
    return q, k, v, cache, meta


def reference(q, cache, meta, scale):
    """Each sequence's query against its own cache entries, one at a time."""
    page = meta.page_size
    out = []
    for b, n in enumerate(meta.seq_lens.tolist()):
        slots = [int(meta.page_table[b, p // page]) * page + p % page for p in range(n)]
        keys = cache[0].flatten(0, 1)[slots].transpose(0, 1)  # [Hkv, n, D]
        values = cache[1].flatten(0, 1)[slots].transpose(0, 1)
        group = q.shape[1] // keys.shape[0]
        o = F.scaled_dot_product_attention(q[b][:, None], keys.repeat_interleave(group, 0),
                                           values.repeat_interleave(group, 0), scale=scale)
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("lengths, heads", [([1], (2, 2)), ([7], (9, 3)), ([5, 13, 1, 8], (9, 3)),
                                            ([4, 4, 4], (4, 1))])
def test_decode_step_matches_per_sequence_attention(lengths, heads):
    q, k, v, cache, meta = decode_step(lengths, *heads)
    out = torch_paged_attention(q, k, v, cache, meta, scale=0.25)
    torch.testing.assert_close(out, reference(q, cache, meta, 0.25), rtol=1e-5, atol=1e-6)
    flat = cache.view(2, -1, *cache.shape[-2:])  # the new K/V were written where the step said
    torch.testing.assert_close(flat[0][meta.slot_mapping], k)
    torch.testing.assert_close(flat[1][meta.slot_mapping], v)


def test_a_sequence_attends_alike_alone_and_in_any_batch():
    """Bit for bit: the keys are padded to a length of the sequence's own, not the step's."""
    q, k, v, cache, meta = decode_step([70, 5, 130, 66, 200], 9, 3, dim=64, page=16)
    together = torch_paged_attention(q, k, v, cache, meta, scale=0.125)
    for b in range(5):
        alone = PagedAttentionMetadata(meta.positions[b:b + 1], meta.slot_mapping[b:b + 1], torch.arange(2),
                                       meta.seq_lens[b:b + 1], meta.page_table[b:b + 1], meta.page_size)
        assert torch.equal(torch_paged_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], cache, alone, 0.125),
                           together[b:b + 1])


def test_a_decoding_sequence_attends_alike_beside_a_prefill():
    q, k, v, cache, meta = decode_step([70, 66], 9, 3, dim=64, page=16)
    decode_only = torch_paged_attention(q, k, v, cache, meta, scale=0.125)
    # the same two decodes with a 3-token prefill of a third sequence between them
    gen = torch.Generator().manual_seed(5)
    free = sorted(set(range(cache.shape[1])) - set(meta.page_table.flatten().tolist()))
    table = torch.cat([meta.page_table, torch.zeros(1, meta.page_table.shape[1], dtype=torch.int64)])
    table = table[[0, 2, 1]]
    table[1, 0] = free[0]
    slots = torch.tensor([int(meta.slot_mapping[0]), free[0] * 16, free[0] * 16 + 1, free[0] * 16 + 2,
                          int(meta.slot_mapping[1])])
    mixed = PagedAttentionMetadata(torch.tensor([69, 0, 1, 2, 65]), slots, torch.tensor([0, 1, 4, 5]),
                                   torch.tensor([70, 3, 66]), table, 16)
    new = [torch.randn(3, heads, 64, generator=gen) for heads in (9, 3, 3)]  # q, k, v of the prefill
    out = torch_paged_attention(torch.cat([q[:1], new[0], q[1:]]), torch.cat([k[:1], new[1], k[1:]]),
                                torch.cat([v[:1], new[2], v[1:]]), cache, mixed, 0.125)
    assert torch.equal(out[[0, 4]], decode_only)
    expected = reference(new[0][-1:], cache, PagedAttentionMetadata(
        torch.tensor([2]), slots[3:4], torch.arange(2), torch.tensor([3]), table[1:2], 16), 0.125)
    torch.testing.assert_close(out[3:4], expected, rtol=1e-5, atol=1e-6)  # the prefill's last token


def test_the_whole_cache_write_writes_as_the_view_write():
    """``write_kv_cache_whole`` (the compiled decode step's write: one ``index_put_`` on the
    cache itself) leaves the cache as ``write_kv_cache`` does, other slots untouched."""
    _, k, v, cache, meta = decode_step([70, 3, 66], 9, 3, dim=64, page=16)
    want, got = cache.clone(), cache.clone()
    write_kv_cache(k, v, want, meta.slot_mapping)
    write_kv_cache_whole(k, v, got, meta.slot_mapping)
    assert torch.equal(got, want) and not torch.equal(got, cache)
