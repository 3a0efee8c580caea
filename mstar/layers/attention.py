"""Paged attention: the dispatcher and the PyTorch reference backend (the cache layout and
the step metadata are in ``mstar.layers.paged_kv``).

``paged_attention`` dispatches on ``PagedAttentionMetadata.backend``: ``"torch"`` is the
reference below (any device, host-synchronising); ``"triton"`` runs the Triton kernels of
``mstar.layers.triton_attention`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), imported only
when first used so that Triton stays an optional dependency.
"""

from __future__ import annotations

import torch

from mstar.layers.paged_kv import (
    ATTENTION_BACKENDS,
    DecodeGroup,
    PagedAttentionMetadata,
    write_kv_cache,
)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    *,
    write_kv: bool = True,
    window: int | None = None,
    merge_in_kernel: bool = False,
) -> torch.Tensor:
    """Paged attention with the implementation named by ``meta.backend``.

    Every backend has the contract of ``torch_paged_attention``: write the new K/V into
    ``kv_cache`` at ``meta.slot_mapping`` (unless ``write_kv`` is False: the caller already
    did, e.g. the fused RoPE kernel), then attend. Returns ``[T, Hq, D]``. ``window`` (a
    sliding-window layer): a token at position ``p`` sees only positions ``> p - window``, in
    the pages of ``meta.windowed`` when the step has them. ``merge_in_kernel``: the Triton
    decode kernel merges its KV splits itself, no combine kernel (see
    ``triton_paged_attention``; the torch backend has nothing to merge).
    """
    if window is not None and meta.windowed is not None:
        meta = meta.windowed
    if meta.backend == "torch":
        return torch_paged_attention(q, k, v, kv_cache, meta, scale, write_kv=write_kv, window=window)
    if window is not None:
        raise NotImplementedError(f"sliding-window attention on the {meta.backend!r} backend; use 'torch'")
    if meta.backend == "triton":
        from mstar.layers.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k, v, kv_cache, meta, scale, write_kv=write_kv,
                                      merge_in_kernel=merge_in_kernel)
    raise ValueError(f"unknown attention backend {meta.backend!r}; expected one of {ATTENTION_BACKENDS}")


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    *,
    write_kv: bool = True,
    window: int | None = None,
) -> torch.Tensor:
    """Reference paged attention (pure PyTorch, any device).

    ``q`` is ``[T, Hq, D]``, ``k``/``v`` are ``[T, Hkv, D]`` with ``Hq`` a multiple of ``Hkv``.
    The new keys/values are first written to ``kv_cache`` at ``meta.slot_mapping`` (skipped
    when ``write_kv`` is False: the caller wrote them, and ``k``/``v`` only give shapes); then each
    sequence gathers its first ``seq_lens[b]`` cached entries through its page table and its
    new tokens attend causally (a token at position ``p`` sees KV positions ``<= p``), which
    covers prefill, decode and chunked-prefill continuation alike. With ``window`` it sees only
    positions ``p - window < kv <= p`` (Hugging Face's sliding-window mask), so the pages of a
    sequence that lie wholly before its window are never read and may be given back to the
    pool (``PagePool.release_before``): their table entries then name any page. Returns
    ``[T, Hq, D]``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")

    if write_kv:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)

    page_size = meta.page_size
    groups, single = meta.decode_groups if window is None else meta.window_decode_groups(window)
    if len(groups) == 1 and groups[0].rows == list(range(q.shape[0])):  # a decode step, one group
        return _decode_attention(q, flat, groups[0], scale)
    out = torch.empty_like(q)
    for group in groups:  # the sequences with one new token, as in a decode step
        out.index_copy_(0, group.index.to(q.device), _decode_attention(q, flat, group, scale))
    starts = meta.query_starts
    seq_lens = meta.seq_lens_list
    offsets = torch.arange(page_size, device=q.device)
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        if end == start or b in single:
            continue
        num_pages = -(-seq_len // page_size)
        pages = meta.page_table[b, :num_pages].to(q.device)
        slots = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]
        keys = flat[0].index_select(0, slots).to(q.dtype)  # [L, Hkv, D]
        values = flat[1].index_select(0, slots).to(q.dtype)

        q_pos = meta.positions[start:end].to(q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # [n, L], True = attend
        if window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - window

        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, n, D]
            keys.transpose(0, 1),  # [Hkv, L, D]
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o.transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, flat: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    """The attention ``[rows, Hq, D]`` of a ``DecodeGroup``: sequences with one new token each
    (at its last position: it sees the whole cache) and KV lengths that round up to the same
    block of keys (``PagedAttentionMetadata.decode_groups``, worked out once per step), as a
    few batched ops with the padding masked.

    On the CPU, ``scaled_dot_product_attention`` with a mask, one sequence at a time, cost
    ~140 us per sequence and layer at SmolLM2's shapes (9 heads over 3, head_dim 64, 200 keys),
    a quarter of its decode step; these ops take ~35 us for a whole group. The padded length
    depends on the sequence alone, and a decoding sequence takes this path in a mixed step
    too: a request's tokens must not depend on what it is batched with (a reduction over
    another length, or another op, may round differently, and bfloat16 products,
    ``mstar.layers.quantized``, turn last-bit differences into different tokens)."""
    rows = len(group.rows)
    query = q if rows == q.shape[0] and group.rows == list(range(rows)) else q.index_select(0, group.index.to(q.device))
    return group_attention(query, flat, group.head_slots(flat.shape[2], q.device), group.padding.to(q.device), scale)


def group_attention(query: torch.Tensor, flat: torch.Tensor, head_slots: torch.Tensor, padding: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``_decode_attention``'s arithmetic on tensors alone (what a compiled decode layer traces,
    ``LlamaDecoderLayer.decode_attention_on``): queries ``[g, Hq, D]``, the cache as flat slots
    ``[2, slots, Hkv, D]``, a ``DecodeGroup``'s ``head_slots [g * Hkv * L]`` and ``padding [g, L]``.

    Keys and values are gathered head-major, ``[g, Hkv, L, D]``, straight from the cache's
    (slot, head) rows, and the scores take the keys as a transposed operand: no permuted copy
    (at 8 streams that copy and a second gather were ~8% of SmolLM2's CPU step)."""
    rows, num_heads, head_dim = query.shape
    num_kv_heads, length = flat.shape[2], padding.shape[1]
    per_head = flat.view(2, -1, head_dim)  # [2, slots * Hkv, D]
    batch = rows * num_kv_heads
    keys = per_head[0].index_select(0, head_slots).view(batch, length, head_dim).to(query.dtype)
    values = per_head[1].index_select(0, head_slots).view(batch, length, head_dim).to(query.dtype)
    scores = torch.bmm(query.reshape(batch, num_heads // num_kv_heads, head_dim), keys.transpose(1, 2)).mul_(scale)
    scores.view(rows, num_heads, length).masked_fill_(padding[:, None, :], float("-inf"))
    return torch.bmm(scores.softmax(-1), values).view(rows, num_heads, head_dim)
