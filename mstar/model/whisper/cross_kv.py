"""Whisper's cross-attention K/V in fixed-shape slots, and one batched cross-attention over them.

Every request's decoder cross-attends to the same ``frames`` (1500) encoder positions at every
step, through keys and values computed once from its audio features. They live in one buffer
allocated at startup, ``[layers, 2, max_requests + 1, frames, heads, head_dim]``: a request
takes a slot on its first step and gives it back when released. Layer ``l``'s view
``buffer[l]`` is ``[2, slots, frames, heads, head_dim]``, exactly the layout of a paged KV cache
whose page size is ``frames``: one page per slot. So a step's cross-attention is one batched
attention over its sequences' slots, with no Python loop over requests:

* ``"torch"`` backend: gather the slots (``index_select``), then one SDPA of ``[B, H, L, Dh]``
  queries (``L`` = most new tokens of one sequence; prefills padded) over ``[B, H, frames, Dh]``.
  A decode step on the CPU instead attends sequence by sequence to views of the slots: the
  gather copies 1500 frames of keys and values per sequence and layer (6 MiB at Whisper base,
  ~2 ms of a 2-core CPU's time per layer, against ~0.25 ms for the two products over views;
  SDPA over a view takes ~0.5 ms at one query).
* ``"triton"`` backend: the paged decode kernel, each new token a one-page "sequence" whose
  page is its slot; no gather, no host synchronisation (CUDA-graph safe). The kernel's
  contract writes new K/V first: those writes go to the last slot, the **sink**, which no
  request owns (it also feeds the padded rows of a CUDA-graph bucket).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.engine.state_pool import OutOfSlots, StatePool
from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import ATTENTION_BACKENDS, PagedAttentionMetadata, to_device


class CrossKVSlots:
    """The cross-attention K/V of up to ``max_requests`` live requests (one slot each).

    ``max_requests`` is the deployment's ``max_concurrent_requests`` (the conductor never has
    more requests live); startup fails, naming that key, when the buffer does not fit in the
    device's free memory. Unused slots are left uninitialised; the sink is zeroed.
    """

    def __init__(self, num_layers: int, max_requests: int, frames: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        device = torch.device(device)
        self.pool = StatePool(max_requests + 1)
        self.frames = frames
        shape = (num_layers, 2, max_requests + 1, frames, num_heads, head_dim)
        need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        free = free_memory_bytes(device)
        if need > free:
            per_slot = need / (max_requests + 1)
            raise ValueError(
                f"max_concurrent_requests ({max_requests}) does not fit: Whisper's cross-attention K/V "
                f"needs {max_requests} slots plus a sink of {per_slot / 2**20:.1f} MiB each "
                f"({need / 2**30:.2f} GiB) and {device} has {free / 2**30:.2f} GiB free; "
                f"lower max_concurrent_requests")
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self.buffer[:, :, self.sink].zero_()
        self.layers: list[torch.Tensor] = list(self.buffer.unbind(0))  # [2, slots, frames, H, Dh] each

    @property
    def sink(self) -> int:
        return self.pool.sink

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def acquire(self, request_id: str) -> int:
        """A free slot for ``request_id`` (its K/V are the caller's to write)."""
        try:
            return self.pool.allocate(request_id)
        except OutOfSlots:
            raise OutOfSlots(f"request {request_id!r} needs a cross-attention K/V slot; all {self.capacity} "
                             f"(max_concurrent_requests) are in use") from None

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)

    def has(self, request_id: str) -> bool:
        return self.pool.has(request_id)

    def slot(self, request_id: str) -> int:
        return self.pool.slot(request_id)

    def held(self) -> dict[str, int]:
        """Request id -> slot of every request holding one."""
        return {request_id: self.pool.slot(request_id) for request_id in self.pool.request_ids()}


def free_memory_bytes(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` may take: free CUDA memory, or the host's
    ``MemAvailable``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class CrossAttentionBatch:
    """Which slot every new token of a decoder step cross-attends to.

    ``slots`` ``[B]``: the slot of each sequence. When some sequence has several new tokens (a
    prefill), token ``t`` belongs to sequence ``token_seq[t]`` and is its ``token_offset[t]``-th
    new token, and ``max_new`` is the most new tokens of one sequence; in a decode step (one
    token per sequence) both are None. ``paged`` is the step as a paged backend (Triton) sees
    it, one one-page sequence per token; None for the torch backend.
    """

    slots: torch.Tensor
    token_seq: torch.Tensor | None = None
    token_offset: torch.Tensor | None = None
    max_new: int = 1
    paged: PagedAttentionMetadata | None = None

    @classmethod
    def build(cls, slots: torch.Tensor, counts: list[int] | None, *, frames: int, sink: int,
              backend: str) -> CrossAttentionBatch:
        """The step whose sequence ``b`` (slot ``slots[b]``, on the device) has ``counts[b]`` new
        tokens. ``counts`` None means one each (a decode step): then the batch is built from
        ``slots`` by device ops alone, so it can be captured in a CUDA graph."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}")
        device = slots.device
        token_seq = token_offset = None
        max_new = 1
        if counts is not None and any(n != 1 for n in counts):
            if len(counts) != slots.shape[0] or min(counts) < 1:
                raise ValueError(f"new-token counts {counts} do not fit {slots.shape[0]} sequences")
            seq = [b for b, n in enumerate(counts) for _ in range(n)]
            offset = [i for n in counts for i in range(n)]
            packed = to_device(torch.tensor(seq + offset, dtype=torch.int64), device)
            token_seq, token_offset = packed.split(len(seq))
            max_new = max(counts)
        paged = None
        if backend != "torch":  # a paged backend: one one-page sequence per token
            token_slots = slots if token_seq is None else slots[token_seq]
            tokens = token_slots.shape[0]
            rows = torch.arange(tokens, dtype=torch.int64, device=device)
            paged = PagedAttentionMetadata(
                positions=torch.full((tokens,), frames - 1, dtype=torch.int64, device=device),
                slot_mapping=sink * frames + rows % frames,  # the write the kernel's contract makes
                query_start_loc=torch.arange(tokens + 1, dtype=torch.int64, device=device),
                seq_lens=torch.full((tokens,), frames, dtype=torch.int64, device=device),
                page_table=token_slots.view(tokens, 1),
                page_size=frames,
                backend=backend,
            )
        return cls(slots, token_seq, token_offset, max_new, paged)


def cross_attention(q: torch.Tensor, cache: torch.Tensor, batch: CrossAttentionBatch, scale: float = 1.0,
                    write_sink: bool = True, merge_in_kernel: bool = False) -> torch.Tensor:
    """Queries ``[T, H, Dh]`` of a step attend (no mask) to their sequences' slots of one layer's
    ``cache`` ``[2, slots, frames, H, Dh]``, logits scaled by ``scale`` (1 for pre-scaled
    queries); returns ``[T, H, Dh]``. ``write_sink`` False skips the paged backend's write of
    the "new K/V" into the sink (two copies per layer nobody reads); ``merge_in_kernel`` as for
    ``paged_attention``."""
    if batch.paged is not None:  # the "new K/V" its contract writes (q itself) land in the sink
        return paged_attention(q, q, q, cache, batch.paged, scale=scale, write_kv=write_sink,
                               merge_in_kernel=merge_in_kernel)
    if batch.token_seq is None and q.device.type == "cpu":
        return _attend_slot_views(q, cache, batch.slots, scale)
    keys = cache[0].index_select(0, batch.slots).transpose(1, 2)  # [B, H, frames, Dh]
    values = cache[1].index_select(0, batch.slots).transpose(1, 2)
    if batch.token_seq is None:
        queries = q.unsqueeze(2)  # [B, H, 1, Dh]
    else:
        padded = q.new_zeros(batch.slots.shape[0], batch.max_new, *q.shape[1:])
        padded[batch.token_seq, batch.token_offset] = q
        queries = padded.transpose(1, 2)  # [B, H, max_new, Dh]
    out = F.scaled_dot_product_attention(queries, keys, values, scale=scale).transpose(1, 2)
    return out.squeeze(1) if batch.token_seq is None else out[batch.token_seq, batch.token_offset]



def _attend_slot_views(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode step's queries ``[B, H, Dh]`` (one per sequence) attending to their slots of
    ``cache`` in place: per sequence, two batched products over ``[H, frames, Dh]`` views
    (the softmax in float32)."""
    out = torch.empty_like(q)
    for b, slot in enumerate(slots.tolist()):
        keys, values = cache[0, slot].transpose(0, 1), cache[1, slot].transpose(0, 1)  # [H, frames, Dh]
        weights = torch.bmm(q[b].unsqueeze(1), keys.transpose(1, 2)).float().mul_(scale).softmax(-1)
        out[b] = torch.bmm(weights.to(values.dtype), values).squeeze(1)
    return out
