"""CUDA-graph capture of decode-only steps of the autoregressive engine.

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
CUDA graph of ``model.forward`` + ``compute_logits`` removes it. One graph is captured per
*bucket* batch size (lazily, on first use); a batch of ``B`` decodes runs in the smallest
bucket ``>= B`` with the extra rows padded:

* token 0 at position 0, ``seq_len`` 1;
* its K/V written to, and read back from, a reserved **scratch page**: the LAST page of the
  KV pool (``num_pages - 1``). The engine must never hand that page to a sequence
  (``AutoregressiveEngine`` gives its ``PagePool`` ``num_pages - 1`` pages when a runner is
  used); padded rows only ever touch it, so real sequences are unaffected;
* a page-table row whose first entry is the scratch page.

The graph reads its inputs from static buffers (the input ids and the metadata tensors, the
page table ``max_pages_per_seq`` wide) that each step overwrites before the replay. The
attention backend must be capturable, i.e. free of host synchronisation: ``"triton"``'s
decode path is (its grid depends on shapes only); the ``"torch"`` reference is not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from mstar.layers.paged_kv import ATTENTION_BACKENDS, PagedAttentionMetadata

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
T = TypeVar("T")


class GraphableDecoder(Protocol):
    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _StaticInputs:
    """Buffers the graphs read, sized for the largest bucket; bucket ``n`` uses ``[:n]``."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [N + 1] int64, always arange: one token per sequence
    seq_lens: torch.Tensor  # [N] int64
    page_table: torch.Tensor  # [N, max_pages_per_seq] int64


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab], overwritten by each replay


def capture_graph(step: Callable[[], T], pool: Any, device: torch.device | None = None,
                  warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run ``warmups`` times on a side stream (kernels compiled, cuBLAS handles and
    kernel choices made outside the capture), then captured into a graph on memory ``pool``;
    the graph and the output tensors it writes at each replay."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output


class BucketGraphs:
    """What the graph runners share: one captured step per batch bucket, captured when first
    needed or all at once (``capture_all``). ``capture`` is False without CUDA, where a
    runner's steps run eagerly."""

    capture: bool
    batch_sizes: tuple[int, ...]
    _steps: dict[int, Any]
    _pool: Any = None

    def _capture(self, bucket: int) -> Any:
        raise NotImplementedError

    def _graph_pool(self) -> Any:
        """The memory pool every graph of this set is captured into (replayed one at a time)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def captured_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._steps))

    def capture_all(self) -> None:
        """Capture every bucket now (a deployment does this at startup, so no request waits
        for a capture or a kernel compile), largest first so the shared pool is sized once;
        nothing to do without CUDA."""
        if self.capture:
            with torch.inference_mode():
                for bucket in sorted(self.batch_sizes, reverse=True):
                    if bucket not in self._steps:
                        self._capture(bucket)


class DecodeGraphRunner(BucketGraphs):
    """Runs decode-only steps as replays of per-bucket CUDA graphs.

    ``kv_caches`` may be ``None`` at construction and bound later with ``bind_kv_caches``
    (the engine does this with the caches it allocates). ``max_pages_per_seq`` is the width
    of the static page table: steps whose page table is wider run eagerly.
    """

    def __init__(
        self,
        model: GraphableDecoder,
        kv_caches: Sequence[torch.Tensor] | None,
        page_size: int,
        max_pages_per_seq: int,
        batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
        backend: str = "triton",
    ) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}")
        if backend == "torch":
            raise ValueError("the 'torch' attention backend synchronises with the host and "
                             "cannot be captured in a CUDA graph; use 'triton'")
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {sizes}")
        if page_size < 1 or max_pages_per_seq < 1:
            raise ValueError("page_size and max_pages_per_seq must be positive")
        self.model = model
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self.backend = backend
        self.kv_caches: list[torch.Tensor] | None = None
        self.scratch_page = -1
        self._inputs: _StaticInputs | None = None
        self._steps: dict[int, _CapturedStep] = {}
        self._pool: Any = None
        if kv_caches is not None:
            self.bind_kv_caches(kv_caches)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def capture(self) -> bool:
        """Whether steps are captured: only over CUDA caches (none bound: nothing yet)."""
        return self.kv_caches is not None and self.kv_caches[0].is_cuda

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Use these per-layer caches (``[2, num_pages, page_size, Hkv, D]``); drops graphs."""
        caches = list(kv_caches)
        if not caches:
            raise ValueError("no KV caches")
        num_pages = caches[0].shape[1]
        for cache in caches:
            if cache.dim() != 5 or cache.shape[1] != num_pages or cache.shape[2] != self.page_size:
                raise ValueError(f"KV cache of shape {tuple(cache.shape)} does not match "
                                 f"{num_pages} pages of {self.page_size} slots")
        if num_pages < 2:
            raise ValueError("the KV pool needs a scratch page besides the real ones")
        self.kv_caches = caches
        self.scratch_page = num_pages - 1
        self._inputs = None
        self._steps.clear()

    # ------------------------------------------------------------------ use
    def can_run(self, items: Sequence[Any], meta: PagedAttentionMetadata | None = None) -> bool:
        """True for a non-empty batch of ``decode`` items, on CUDA, within the largest bucket
        (and, given the step's metadata, one token per sequence and a page table that fits)."""
        if any(getattr(item, "op", None) != "decode" for item in items):
            return False
        return self.fits(len(items), meta)

    def fits(self, batch: int, meta: PagedAttentionMetadata | None = None) -> bool:
        """True for a step of ``batch`` sequences, one token each, that a bucket holds (on
        CUDA; given the step's metadata, with a page table that fits)."""
        if self.kv_caches is None or not self.kv_caches[0].is_cuda:
            return False
        if not 0 < batch <= self.max_batch_size:
            return False
        if meta is not None:
            if meta.positions.shape[0] != meta.seq_lens.shape[0] or meta.seq_lens.shape[0] != batch:
                return False
            if meta.page_table.shape[1] > self.max_pages_per_seq or meta.page_size != self.page_size:
                return False
        return True

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode-only step (``B`` tokens, one per sequence).

        Writes the step's K/V to the caches exactly as an eager ``model.forward`` would.
        """
        batch = int(input_ids.shape[0])
        if not 0 < batch <= self.max_batch_size:
            raise ValueError(f"batch of {batch} does not fit buckets {self.batch_sizes}")
        if meta.page_table.shape[1] > self.max_pages_per_seq:
            raise ValueError(f"page table of width {meta.page_table.shape[1]} exceeds "
                             f"max_pages_per_seq={self.max_pages_per_seq}")
        bucket = next(size for size in self.batch_sizes if size >= batch)
        with torch.inference_mode():
            step = self._steps.get(bucket) or self._capture(bucket)
            self._load(input_ids, meta, batch, bucket)
            step.graph.replay()
            return step.logits[:batch].clone()

    # -------------------------------------------------------------- internals
    def _static_inputs(self) -> _StaticInputs:
        if self._inputs is None:
            assert self.kv_caches is not None, "bind_kv_caches first"
            n, device = self.max_batch_size, self.kv_caches[0].device

            def zeros(*shape: int) -> torch.Tensor:
                return torch.zeros(shape, dtype=torch.int64, device=device)

            self._inputs = _StaticInputs(
                input_ids=zeros(n), positions=zeros(n), slot_mapping=zeros(n),
                query_start_loc=torch.arange(n + 1, dtype=torch.int64, device=device),
                seq_lens=zeros(n), page_table=zeros(n, self.max_pages_per_seq),
            )
            self._pad(0, n)
        return self._inputs

    def _pad(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` padding rows that only touch the scratch page."""
        if start >= end:
            return
        s = self._static_inputs()
        s.input_ids[start:end].zero_()
        s.positions[start:end].zero_()
        s.slot_mapping[start:end].fill_(self.scratch_page * self.page_size)
        s.seq_lens[start:end].fill_(1)
        s.page_table[start:end].zero_()
        s.page_table[start:end, 0].fill_(self.scratch_page)

    def _load(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, batch: int, bucket: int) -> None:
        """Copy a step's inputs into the static buffers (rows ``[batch, bucket)`` padded)."""
        s = self._static_inputs()
        width = meta.page_table.shape[1]
        s.input_ids[:batch].copy_(input_ids, non_blocking=True)
        s.positions[:batch].copy_(meta.positions, non_blocking=True)
        s.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        s.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        s.page_table[:batch, :width].copy_(meta.page_table, non_blocking=True)
        s.page_table[:batch, width:].zero_()
        self._pad(batch, bucket)

    def _meta(self, bucket: int) -> PagedAttentionMetadata:
        s = self._static_inputs()
        return PagedAttentionMetadata(
            positions=s.positions[:bucket],
            slot_mapping=s.slot_mapping[:bucket],
            query_start_loc=s.query_start_loc[: bucket + 1],
            seq_lens=s.seq_lens[:bucket],
            page_table=s.page_table[:bucket],
            page_size=self.page_size,
            backend=self.backend,
        )

    def _step(self, bucket: int) -> torch.Tensor:
        """What the graph records: forward then logits (each row is its sequence's last)."""
        assert self.kv_caches is not None
        hidden = self.model.forward(self._static_inputs().input_ids[:bucket], self._meta(bucket),
                                    self.kv_caches)
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int) -> _CapturedStep:
        """Warm up (compiling kernels) on a side stream, then capture into the shared pool.

        All rows are padding during both, so they write only to the scratch page.
        """
        assert self.kv_caches is not None
        self._pad(0, bucket)
        graph, logits = capture_graph(lambda: self._step(bucket), self._graph_pool(), self.kv_caches[0].device)
        self._steps[bucket] = step = _CapturedStep(graph, logits)
        return step
