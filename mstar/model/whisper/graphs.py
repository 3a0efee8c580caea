"""CUDA-graph replay of Whisper's decode-only steps, one graph per batch bucket.

The pattern of ``mstar.engine.cuda_graphs.DecodeGraphRunner``, with one more graph input: the
cross-attention slot of every sequence (that runner's captured step reads only the token ids
and the paged metadata). A batch of ``B`` decodes runs in the smallest bucket ``>= B``; the
padded rows are token 0 at position 0 whose self-attention K/V go to, and are read from, a
**scratch page** no sequence owns, and whose cross-attention reads the sink slot of the
``CrossKVSlots``. Their hidden states are dropped.

The graph reads its inputs from static buffers that each step overwrites before the replay.
The attention backend must be free of host synchronisation, i.e. ``"triton"``. What is
captured is the decoder up to its final norm; the engine computes the logits.

Without CUDA (tests on the CPU), the same buffers, padding and buckets run eagerly instead of
replaying a graph, with any backend: that checks everything but the capture itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, BucketGraphs, capture_graph
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots


@dataclass
class _StaticInputs:
    """Buffers the graphs read, sized for the largest bucket; bucket ``n`` uses ``[:n]``."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [N + 1], always arange: one token per sequence
    seq_lens: torch.Tensor  # [N]
    page_table: torch.Tensor  # [N, max_pages_per_seq]
    cross_slots: torch.Tensor  # [N] the cross-attention K/V slot of each sequence


class WhisperDecodeGraphs(BucketGraphs):
    """Runs decode-only steps of ``model.decode`` as per-bucket graph replays.

    ``scratch_page`` is a page of ``kv_caches`` the engine never gives a sequence;
    ``max_pages_per_seq`` the width of the static page table (wider steps do not fit).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], cross: CrossKVSlots, *, page_size: int,
                 max_pages_per_seq: int, scratch_page: int, batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
                 backend: str = "triton") -> None:
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {sizes}")
        self.capture = kv_caches[0].is_cuda
        if self.capture and backend != "triton":
            raise ValueError(f"the {backend!r} attention backend synchronises with the host and cannot be "
                             "captured in a CUDA graph; use 'triton'")
        if not 0 <= scratch_page < kv_caches[0].shape[1]:
            raise ValueError(f"scratch page {scratch_page} is not a page of the KV caches")
        self.model = model
        self.kv_caches = kv_caches
        self.cross = cross
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.scratch_page = scratch_page
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self.backend = backend
        self._inputs = self._allocate(kv_caches[0].device)
        self._pad(0, self.max_batch_size)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool = None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def fits(self, batch: int, meta: PagedAttentionMetadata) -> bool:
        """True for a step of ``batch`` sequences with one new token each that a bucket holds."""
        return (0 < batch <= self.max_batch_size
                and meta.positions.shape[0] == meta.seq_lens.shape[0] == batch
                and meta.page_table.shape[1] <= self.max_pages_per_seq
                and meta.page_size == self.page_size)

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, slots: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, d_model]`` of a decode-only step whose sequence ``b`` reads cross
        K/V slot ``slots[b]``; the caches are written exactly as by an eager ``model.decode``."""
        batch = int(input_ids.shape[0])
        if not self.fits(batch, meta) or slots.shape[0] != batch:
            raise ValueError(f"a step of {batch} tokens does not fit buckets {self.batch_sizes} "
                             f"(or its metadata is not decode-only)")
        bucket = next(size for size in self.batch_sizes if size >= batch)
        with torch.inference_mode():
            replay = self._steps.get(bucket) or self._capture(bucket)
            self._load(input_ids, meta, slots, batch, bucket)
            return replay()[:batch].clone()

    # -------------------------------------------------------------- internals
    def _allocate(self, device: torch.device) -> _StaticInputs:
        n = self.max_batch_size

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return _StaticInputs(
            input_ids=zeros(n), positions=zeros(n), slot_mapping=zeros(n),
            query_start_loc=torch.arange(n + 1, dtype=torch.int64, device=device),
            seq_lens=zeros(n), page_table=zeros(n, self.max_pages_per_seq), cross_slots=zeros(n))

    def _pad(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` padding that touches only the scratch page and the sink."""
        if start >= end:
            return
        s = self._inputs
        s.input_ids[start:end].zero_()
        s.positions[start:end].zero_()
        s.slot_mapping[start:end].fill_(self.scratch_page * self.page_size)
        s.seq_lens[start:end].fill_(1)
        s.page_table[start:end].zero_()
        s.page_table[start:end, 0].fill_(self.scratch_page)
        s.cross_slots[start:end].fill_(self.cross.sink)

    def _load(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, slots: torch.Tensor,
              batch: int, bucket: int) -> None:
        s = self._inputs
        width = meta.page_table.shape[1]
        s.input_ids[:batch].copy_(input_ids, non_blocking=True)
        s.positions[:batch].copy_(meta.positions, non_blocking=True)
        s.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        s.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        s.page_table[:batch, :width].copy_(meta.page_table, non_blocking=True)
        s.page_table[:batch, width:].zero_()
        s.cross_slots[:batch].copy_(slots, non_blocking=True)
        self._pad(batch, bucket)

    def _step(self, bucket: int) -> torch.Tensor:
        """What a graph records: the decoder over the first ``bucket`` rows of the buffers."""
        s = self._inputs
        meta = PagedAttentionMetadata(
            positions=s.positions[:bucket], slot_mapping=s.slot_mapping[:bucket],
            query_start_loc=s.query_start_loc[:bucket + 1], seq_lens=s.seq_lens[:bucket],
            page_table=s.page_table[:bucket], page_size=self.page_size, backend=self.backend)
        cross = CrossAttentionBatch.build(s.cross_slots[:bucket], None, frames=self.cross.frames,
                                          sink=self.cross.sink, backend=self.backend)
        return self.model.decode(s.input_ids[:bucket], meta, self.kv_caches, self.cross.layers, cross)

    def _capture(self, bucket: int) -> Callable[[], torch.Tensor]:
        """Warm up (compiling kernels) on a side stream, then capture into the shared pool; all
        rows are padding meanwhile. Without CUDA the step just runs eagerly when called."""
        if not self.capture:
            self._steps[bucket] = replay = lambda: self._step(bucket)
            return replay
        self._pad(0, bucket)
        graph, hidden = capture_graph(lambda: self._step(bucket), self._graph_pool(), self.kv_caches[0].device)

        def replay() -> torch.Tensor:
            graph.replay()
            return hidden

        self._steps[bucket] = replay
        return replay


class WhisperEncoderGraphs(BucketGraphs):
    """The encoder's forward as per-bucket CUDA-graph replays (``model_kwargs.cuda_graphs``).

    At one clip the encoder is launch-bound (hundreds of small kernels over ~6 ms of GPU
    work); a replay launches them at once. A batch of ``B`` log-mels runs in the smallest
    bucket ``>= B``: the static input's rows past ``B`` are zero mels whose features are
    dropped (every row of the encoder is independent of the others); the features are cloned
    out of the graph's memory. Batches past the largest bucket run eagerly. Without CUDA the
    same padded buffers run eagerly (tests). CUDA graphs rather than ``torch.compile``: the
    same capture pattern as the decoder, no compile time at startup, and no recompiles per
    batch size; the kernels are cuBLAS/SDPA either way, so at 32 clips, where the encoder is
    compute-bound, compile has little left to fuse.
    """

    def __init__(self, model, batch_sizes: Iterable[int]) -> None:
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {sizes}")
        self.model = model
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        weight = model.model.encoder.conv1.weight
        self.capture = weight.is_cuda
        config = model.config
        self._mel = torch.zeros(sizes[-1], config.num_mel_bins, config.num_mel_frames, dtype=weight.dtype,
                                device=weight.device)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool = None

    def run(self, mel: torch.Tensor) -> torch.Tensor:
        """Audio features ``[B, frames, d_model]`` of log-mels ``[B, n_mels, num_mel_frames]``,
        as ``model.encode`` computes them."""
        batch = int(mel.shape[0])
        if mel.dim() != 3 or tuple(mel.shape[1:]) != tuple(self._mel.shape[1:]) or batch > self.batch_sizes[-1]:
            return self.model.encode(mel)  # eager: a batch past the buckets (or a shape encode refuses)
        bucket = next(size for size in self.batch_sizes if size >= batch)
        with torch.inference_mode():
            replay = self._steps.get(bucket) or self._capture(bucket)
            self._mel[:batch].copy_(mel, non_blocking=True)
            self._mel[batch:bucket].zero_()
            return replay()[:batch].clone()

    def _capture(self, bucket: int) -> Callable[[], torch.Tensor]:
        mel = self._mel[:bucket]
        if not self.capture:
            self._steps[bucket] = replay = lambda: self.model.encode(mel)
            return replay
        graph, features = capture_graph(lambda: self.model.encode(mel), self._graph_pool(), mel.device)

        def replay() -> torch.Tensor:
            graph.replay()
            return features

        self._steps[bucket] = replay
        return replay
