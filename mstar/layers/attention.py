"""Paged attention: the per-step metadata and the PyTorch reference backend.

The KV cache of one attention layer is one tensor of shape
``[2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 = keys, 1 = values).
A step runs ``T`` new tokens belonging to ``B`` sequences, flattened in sequence order.

``paged_attention`` dispatches on ``PagedAttentionMetadata.backend``: ``"torch"`` is the
reference below (any device, host-synchronising); ``"triton"`` runs the Triton kernels of
``mstar.layers.triton_attention`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), imported only
when first used so that Triton stays an optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything an attention layer needs to know about one batched step.

    Built once per step by the autoregressive engine and passed explicitly to the model
    (no globals).
    """

    positions: torch.Tensor  # [T] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset where its K/V go
    query_start_loc: torch.Tensor  # [B + 1] int64: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64: KV length of each sequence after this step
    page_table: torch.Tensor  # [B, max_pages] int64: page ids, padded with 0
    page_size: int
    backend: str = "torch"  # attention implementation: "torch" (reference) or "triton"

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def allocate_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed ``[2, num_pages, page_size, num_kv_heads, head_dim]`` tensor per layer."""
    shape = (2, num_pages, page_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into their flat slots of ``kv_cache`` (in place)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


ATTENTION_BACKENDS = ("torch", "triton")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    *,
    write_kv: bool = True,
) -> torch.Tensor:
    """Paged attention with the implementation named by ``meta.backend``.

    Every backend has the contract of ``torch_paged_attention``: write the new K/V into
    ``kv_cache`` at ``meta.slot_mapping`` (unless ``write_kv`` is False: the caller already
    did, e.g. the fused RoPE kernel), then attend. Returns ``[T, Hq, D]``.
    """
    if meta.backend == "torch":
        return torch_paged_attention(q, k, v, kv_cache, meta, scale, write_kv=write_kv)
    if meta.backend == "triton":
        from mstar.layers.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k, v, kv_cache, meta, scale, write_kv=write_kv)
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
) -> torch.Tensor:
    """Reference paged attention (pure PyTorch, any device).

    ``q`` is ``[T, Hq, D]``, ``k``/``v`` are ``[T, Hkv, D]`` with ``Hq`` a multiple of ``Hkv``.
    The new keys/values are first written to ``kv_cache`` at ``meta.slot_mapping`` (skipped
    when ``write_kv`` is False: the caller wrote them, and ``k``/``v`` only give shapes); then each
    sequence gathers its first ``seq_lens[b]`` cached entries through its page table and its
    new tokens attend causally (a token at position ``p`` sees KV positions ``<= p``), which
    covers prefill, decode and chunked-prefill continuation alike. Returns ``[T, Hq, D]``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")

    if write_kv:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)

    page_size = meta.page_size
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    out = torch.empty_like(q)
    offsets = torch.arange(page_size, device=q.device)
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        num_pages = -(-seq_len // page_size)
        pages = meta.page_table[b, :num_pages].to(q.device)
        slots = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]
        keys = flat[0].index_select(0, slots).to(q.dtype)  # [L, Hkv, D]
        values = flat[1].index_select(0, slots).to(q.dtype)

        q_pos = meta.positions[start:end].to(q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # [n, L], True = attend

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
