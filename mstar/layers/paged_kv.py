"""The paged KV cache and the per-step metadata every attention backend reads.

The KV cache of one attention layer is one tensor of shape
``[2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 = keys, 1 = values), or, for a
layer that caches one compressed row per token instead of keys and values (multi-head latent
attention: GLM-5.2's latent, rotary key and indexer key), ``[1, num_pages, page_size, 1, width]``
(``planes=1``); the pages and slots are the same either way. A step
runs ``T`` new tokens belonging to ``B`` sequences, flattened in sequence order; the engine
describes it in one ``PagedAttentionMetadata``. The backends themselves are in
``mstar.layers.attention`` (the reference and the dispatcher) and
``mstar.layers.triton_attention``.
"""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass, field

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
    # ``query_start_loc`` and ``seq_lens`` as host lists, when the builder has them: a backend
    # that splits a mixed step on the host then never reads the device tensors back (a wait
    # for the device in every layer of the step).
    host_query_start_loc: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None
    # The sliding-window layers' own step metadata when they keep their K/V in a pool of their
    # own (``mstar.engine.window_pages``): the same step, other slots and page table. None:
    # every layer reads this one.
    windowed: PagedAttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @functools.cached_property
    def query_starts(self) -> list[int]:
        """``query_start_loc`` on the host (read back at most once per step)."""
        if self.host_query_start_loc is not None:
            return list(self.host_query_start_loc)
        return self.query_start_loc.tolist()

    @functools.cached_property
    def seq_lens_list(self) -> list[int]:
        """``seq_lens`` on the host (read back at most once per step)."""
        if self.host_seq_lens is not None:
            return list(self.host_seq_lens)
        return self.seq_lens.tolist()

    @functools.cached_property
    def strided(self) -> str | None:
        """The first of the index tensors that is not contiguous (a kernel reading them by
        element would misread it), or None; worked out once per step."""
        for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens"):
            if not getattr(self, name).is_contiguous():
                return name
        return "page_table" if self.page_table.stride(-1) != 1 else None

    @functools.cached_property
    def step_tensors(self) -> dict[object, torch.Tensor]:
        """Device tensors a backend derives from this step's metadata, made by the first
        layer that needs them and reused by the others (keys are the backend's own)."""
        return {}

    @functools.cached_property
    def decode_groups(self) -> tuple[list[DecodeGroup], set[int]]:
        """The sequences of the step with one new token (a decode; at its last position),
        grouped by their KV length rounded up to ``DECODE_KEY_BUCKET``: what every layer's
        attention gathers for them. Also the set of those sequences. Worked out on first use,
        once per step."""
        starts = self.query_starts
        lengths = self.seq_lens_list
        single = [b for b in range(len(lengths)) if starts[b + 1] - starts[b] == 1]
        if not single:
            return [], set()
        bucket = DECODE_KEY_BUCKET
        padded = {b: -(-lengths[b] // bucket) * bucket for b in single}
        width = -(-max(padded.values()) // self.page_size)
        pages = self.page_table[:, :width]
        if pages.shape[1] < width:  # the table is narrower than the padding: pad it with page 0
            pages = torch.nn.functional.pad(pages, (0, width - pages.shape[1]))
        offsets = torch.arange(self.page_size, device=pages.device)
        slots = (pages[:, :, None] * self.page_size + offsets).flatten(1)
        groups = []
        for length in sorted(set(padded.values())):
            seqs = [b for b in single if padded[b] == length]
            which = to_device(torch.tensor(seqs), slots.device)
            positions = torch.arange(length, device=slots.device)
            padding = positions >= self.seq_lens.index_select(0, which)[:, None]
            group_slots = slots.index_select(0, which)[:, :length].masked_fill(padding, 0)
            rows = [starts[b] for b in seqs]  # their tokens' places in the step
            groups.append(DecodeGroup(rows, to_device(torch.tensor(rows), slots.device), group_slots.flatten(), length,
                                      padding))
        return groups, set(single)

    def window_decode_groups(self, window: int) -> tuple[list[DecodeGroup], set[int]]:
        """``decode_groups`` for a sliding-window layer: each sequence with one new token (KV
        length ``n``) gathers only its last ``min(n, window)`` keys, in a block of that many
        rounded up to ``DECODE_KEY_BUCKET`` that ends at its last key (the positions before
        its window, or before 0, masked in ``padding``): the work is the window's however
        long the sequence. Worked out on first use, once per step and window."""
        if window in self._window_groups:
            return self._window_groups[window]
        starts = self.query_starts
        lengths = self.seq_lens_list
        single = [b for b in range(len(lengths)) if starts[b + 1] - starts[b] == 1]
        bucket = DECODE_KEY_BUCKET
        padded = {b: -(-min(lengths[b], window) // bucket) * bucket for b in single}
        groups = []
        for length in sorted(set(padded.values())):
            seqs = [b for b in single if padded[b] == length]
            which = to_device(torch.tensor(seqs), self.page_table.device)
            ends = self.seq_lens.index_select(0, which)[:, None]  # [g, 1]
            positions = ends - length + torch.arange(length, device=ends.device)  # [g, L], the last at n - 1
            padding = positions < (ends - window).clamp(min=0)
            held = positions.clamp(min=0)
            pages = self.page_table.index_select(0, which).gather(1, held // self.page_size)
            slots = (pages * self.page_size + held % self.page_size).masked_fill(padding, 0)
            rows = [starts[b] for b in seqs]
            groups.append(DecodeGroup(rows, to_device(torch.tensor(rows), slots.device), slots.flatten(), length,
                                      padding))
        self._window_groups[window] = groups, set(single)
        return self._window_groups[window]

    @functools.cached_property
    def _window_groups(self) -> dict[int, tuple[list[DecodeGroup], set[int]]]:
        """``window_decode_groups`` by window, made this step."""
        return {}


DECODE_KEY_BUCKET = 64
"""Keys are gathered for a decode step in blocks of this many (the padding masked), so that a
sequence's attention has the same shapes, and rounds the same, whatever it is batched with."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decoding sequences whose KV lengths round up to the same ``length``: ``rows`` (their
    tokens' places in the step, as a list and as ``index``), the cache ``slots [rows * length]`` of
    their keys (slot 0 in the padding) and the ``padding [rows, length]`` mask."""

    rows: list[int]
    index: torch.Tensor
    slots: torch.Tensor
    length: int
    padding: torch.Tensor
    _head_slots: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def head_slots(self, num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """The rows ``[rows * num_kv_heads * length]`` of the group's keys in a cache seen as
        ``[2, slots * num_kv_heads, head_dim]``, head-major (``head_major_slots``); made once
        a step, on ``device``, and shared by the layers."""
        key = (num_kv_heads, device)
        if key not in self._head_slots:
            self._head_slots[key] = head_major_slots(self.slots.to(device), len(self.rows), num_kv_heads)
        return self._head_slots[key]


def head_major_slots(slots: torch.Tensor, rows: int, num_kv_heads: int) -> torch.Tensor:
    """Cache slots ``[rows * length]`` as the rows of a cache seen as ``[2, slots * Hkv, D]``
    in the order ``[rows, Hkv, length]``: what gathers each head's keys as one contiguous
    ``[length, D]`` block."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots.view(rows, 1, -1) * num_kv_heads + heads.view(1, -1, 1)).flatten()


def int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` on the host, made ~3x faster (3.3 -> 1.1 us
    for 12 ids, 12.9 -> 3.9 us for 200): ``array`` packs the ints in C and the tensor shares
    its buffer (keeping it alive). A step's metadata is built from one such list."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``, copied without waiting for the device (pinned memory,
    non-blocking), so launching a step never stalls on the previous one. A tensor already on
    a device is moved as ``.to`` would; one on the host staying there is itself (what ``.to``
    returns, without the op's dispatch)."""
    if tensor.device.type != "cpu":
        return tensor.to(device)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def allocate_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    planes: int = 2,
) -> list[torch.Tensor]:
    """One zeroed ``[planes, num_pages, page_size, num_kv_heads, head_dim]`` tensor per layer
    (``planes``: 2 for keys and values, 1 for one latent row per token)."""
    if planes not in (1, 2):
        raise ValueError(f"a KV cache holds 1 (latent) or 2 (keys, values) planes, not {planes}")
    shape = (planes, num_pages, page_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into their flat slots of ``kv_cache`` (in place)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def write_kv_cache_whole(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``write_kv_cache`` as one ``index_put_`` on ``kv_cache`` itself, indexed by (K or V,
    page, offset) rather than through a view: the form a ``torch.compile``d graph can write
    in place. Mutating a view of a graph input (``write_kv_cache``'s ``flat[0]``) made
    inductor copy the whole cache tensor on every call (a few hundred ms a step for
    SmolLM2's pool); a mutation of the input itself it leaves in place."""
    page_size = kv_cache.shape[2]
    kv = torch.stack((k, v)).to(kv_cache.dtype)  # [2, T, Hkv, D]
    which = torch.arange(2, device=kv.device)[:, None]
    kv_cache.index_put_((which, (slot_mapping // page_size)[None], (slot_mapping % page_size)[None]), kv)


ATTENTION_BACKENDS = ("torch", "triton")
