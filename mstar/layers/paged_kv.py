"""The paged KV cache and the per-step metadata every attention backend reads.

The KV cache of one attention layer is one tensor of shape
``[2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 = keys, 1 = values). A step
runs ``T`` new tokens belonging to ``B`` sequences, flattened in sequence order; the engine
describes it in one ``PagedAttentionMetadata``. The backends themselves are in
``mstar.layers.attention`` (the reference and the dispatcher) and
``mstar.layers.triton_attention``.
"""

from __future__ import annotations

import functools
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

    @functools.cached_property
    def decode_gather(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """For a step of one new token per sequence, what every layer's attention gathers:
        ``(slots, longest, padding)``: the flat cache slots ``[B * longest]`` of each
        sequence's keys (padded to the longest, with slot 0), and the mask ``[B, longest]`` of
        the padding (None for one sequence). Computed on first use, once per step."""
        longest = int(self.seq_lens.max())
        pages = self.page_table[:, :-(-longest // self.page_size)]
        offsets = torch.arange(self.page_size, device=pages.device)
        slots = (pages[:, :, None] * self.page_size + offsets).flatten(1)[:, :longest]
        padding = None
        if slots.shape[0] > 1:
            padding = torch.arange(longest, device=pages.device) >= self.seq_lens[:, None]
            slots = slots.masked_fill(padding, 0)
        return slots.flatten(), longest, padding


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
