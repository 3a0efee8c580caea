"""CUDA graphs: one runner for every forward the deployments replay.

A step of a small model (a decode step, Whisper's encoder at one clip, a diffusion text
encoder at batch 1) is dominated by kernel-launch overhead: hundreds of small kernels whose
launches take longer on the host than they take on the GPU. Replaying a captured CUDA graph
launches them at once. ``GraphRunner`` is the one runner: it captures ``step(key)`` once per
key, after warm-up runs on a side stream (kernels compiled, cuBLAS handles and kernel choices
made outside the capture), into one memory pool its graphs share (they are replayed one at a
time, each output read before the next replay), and replays it. Its front ends:

* ``BucketGraphs``: a batch-first step per batch *bucket*. A batch of ``B`` rows runs in the
  smallest bucket ``>= B``: its inputs are copied into the first ``B`` rows of static
  buffers, the rows up to the bucket are padding, and the output's first ``B`` rows are
  copied out. Whisper's encoder replays through it (padded with zero mels).
* ``DecodeGraphs``: the autoregressive engine's decode-only steps on ``BucketGraphs``, the
  input ids and paged-attention metadata in static buffers, plus any per-row inputs of the
  model's: an index (Whisper's cross-attention slot, a Mamba state slot) or a row of any width
  (the duplex LLM's fused input embedding). Padded rows are token 0 at position 0 whose K/V
  go to, and are read from, a **scratch page** no sequence owns.
* ``PrefillGraphs``: the engine's fresh prefill of one sequence (no cached prefix) per token
  bucket: the prompt padded to the bucket, padded tokens' K/V into the scratch page, the
  logits of the last real token out. A prompt's eager prefill is host-bound (a Llama-8B
  layer ~0.9 ms of Python and launches at 128 tokens, against ~0.15 ms of GPU work).
* ``ShapeGraphs``: ``fn(*inputs)`` per caller-given key (the inputs' shapes and whatever
  Python-level choice changes the launched kernels), over static copies of the first inputs
  of that key, at most ``max_graphs`` keys (the diffusion text encoders).

A captured step must be free of host synchronisation and data-dependent shapes (for the
paged attention: the ``"triton"`` backend, not the ``"torch"`` reference). The same kernels
run as eagerly, so a replay's output equals eager's on the same inputs. Off CUDA nothing is
captured: each replay runs the step eagerly over the same buffers, padding and buckets, so the
tests on the CPU check everything but the capture itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from mstar.layers.paged_kv import ATTENTION_BACKENDS, PagedAttentionMetadata

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_MAX_GRAPHS = 16
DEFAULT_PREFILL_TOKENS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


def buckets_up_to(most: int, sizes: Iterable[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The batch buckets a deployment of at most ``most`` rows captures: ``sizes`` below it,
    then ``most`` itself."""
    return (*(n for n in sorted(sizes) if n < most), most)


class GraphRunner:
    """``step(key)`` captured per key on ``device`` and replayed; run eagerly off CUDA. The
    step's output is a tensor or any structure of them (the graph's own)."""

    def __init__(self, step: Callable[[Any], Any], device: torch.device, warmups: int = 1):
        self.step = step
        self.device = device
        self.capture = device.type == "cuda"
        self.warmups = warmups
        self._replays: dict[Hashable, Callable[[], Any]] = {}
        self._pool: Any = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._replays

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._replays)

    def prepare(self, key: Hashable) -> None:
        """Capture ``step(key)`` now (off CUDA: remember the key, its replays run eagerly)."""
        if not self.capture:
            self._replays[key] = lambda: self.step(key)
            return
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmups):
                self.step(key)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.step(key)

        def replay() -> Any:
            graph.replay()
            return output

        self._replays[key] = replay

    def replay(self, key: Hashable) -> Any:
        """The output of ``step(key)`` (a prepared key): the graph's own tensor, which the next
        replay of any key may overwrite."""
        return self._replays[key]()


class BucketGraphs:
    """``step(rows)`` over the static batch-first ``buffers`` (name -> ``[max_bucket, ...]``),
    ``rows`` their first ``bucket`` rows, replayed per bucket of ``batch_sizes``. ``pads``:
    what a padded row of each buffer holds (a number, or a row tensor). During a capture every
    row is padding."""

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], torch.Tensor], buffers: dict[str, torch.Tensor],
                 pads: dict[str, float | torch.Tensor], batch_sizes: Iterable[int]):
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {sizes}")
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self.buffers = buffers
        self.pads = pads
        device = next(iter(buffers.values())).device
        self.runner = GraphRunner(lambda bucket: step({name: b[:bucket] for name, b in buffers.items()}), device)
        self._pad(0, self.max_batch_size)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def captured_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.runner.keys))

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch_size

    def run(self, batch: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's output rows of a batch of ``batch`` rows (a copy), each buffer's first
        rows holding ``inputs[name]``. An input narrower than its buffer in the last dimension
        (a page table) fills each row's leading columns, zeros after."""
        if not self.fits(batch):
            raise ValueError(f"a batch of {batch} does not fit buckets {self.batch_sizes}")
        bucket = next(size for size in self.batch_sizes if size >= batch)
        with torch.inference_mode():
            if bucket not in self.runner:
                self._prepare(bucket)
            for name, value in inputs.items():
                rows = self.buffers[name][:batch]
                if value.dim() > 1 and value.shape[-1] < rows.shape[-1]:
                    rows[..., value.shape[-1]:].zero_()
                    rows = rows[..., :value.shape[-1]]
                rows.copy_(value, non_blocking=True)
            self._pad(batch, bucket)
            return self.runner.replay(bucket)[:batch].clone()

    def capture_all(self) -> None:
        """Capture every bucket now (a deployment does this at startup, so no request waits
        for a capture or a kernel compile), largest first so the shared pool is sized once;
        nothing to do off CUDA."""
        if self.runner.capture:
            with torch.inference_mode():
                for bucket in sorted(self.batch_sizes, reverse=True):
                    if bucket not in self.runner:
                        self._prepare(bucket)

    def _prepare(self, bucket: int) -> None:
        self._pad(0, bucket)
        self.runner.prepare(bucket)

    def _pad(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` of every buffer padding."""
        if start >= end:
            return
        for name, buffer in self.buffers.items():
            pad = self.pads[name]
            if isinstance(pad, torch.Tensor):
                buffer[start:end].copy_(pad)
            else:
                buffer[start:end].fill_(pad)


class DecodeGraphs:
    """Decode-only steps (one new token per sequence) as per-bucket replays of
    ``step(input_ids, meta, rows)``, where ``rows`` holds the model's per-row inputs besides
    the ids and metadata (``row_pads``: name -> a padded row's value: an int, for an int64
    index per row, or a tensor, for a row of its shape and dtype). ``scratch_page`` is a page
    of the KV caches the engine never gives a sequence; ``max_pages_per_seq`` the width of
    the static page table (steps with a wider one do not fit)."""

    def __init__(self, step: Callable[[torch.Tensor, PagedAttentionMetadata, dict[str, torch.Tensor]], torch.Tensor],
                 *, device: torch.device, page_size: int, max_pages_per_seq: int, scratch_page: int,
                 batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES, backend: str = "triton",
                 row_pads: dict[str, int | torch.Tensor] | None = None) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}")
        if device.type == "cuda" and backend == "torch":
            raise ValueError("the 'torch' attention backend synchronises with the host and cannot be "
                             "captured in a CUDA graph; use 'triton'")
        if page_size < 1 or max_pages_per_seq < 1:
            raise ValueError("page_size and max_pages_per_seq must be positive")
        self.step = step
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.backend = backend
        self.row_pads = {name: pad.to(device) if isinstance(pad, torch.Tensor) else pad
                         for name, pad in (row_pads or {}).items()}
        n = max(int(s) for s in batch_sizes)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        def row_buffer(pad: int | torch.Tensor) -> torch.Tensor:
            if isinstance(pad, torch.Tensor):
                return torch.zeros((n, *pad.shape), dtype=pad.dtype, device=device)
            return zeros(n)

        table_pad = zeros(max_pages_per_seq)
        table_pad[0] = scratch_page
        buffers = {"input_ids": zeros(n), "positions": zeros(n), "slot_mapping": zeros(n), "seq_lens": zeros(n),
                   "page_table": zeros(n, max_pages_per_seq)} | {name: row_buffer(pad)
                                                                  for name, pad in self.row_pads.items()}
        pads = {"input_ids": 0, "positions": 0, "slot_mapping": scratch_page * page_size, "seq_lens": 1,
                "page_table": table_pad} | self.row_pads
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)  # one token per sequence
        self.graphs = BucketGraphs(self._step, buffers, pads, batch_sizes)

    @property
    def max_batch_size(self) -> int:
        return self.graphs.max_batch_size

    @property
    def captured_batch_sizes(self) -> tuple[int, ...]:
        return self.graphs.captured_batch_sizes

    def capture_all(self) -> None:
        self.graphs.capture_all()

    def fits(self, batch: int, meta: PagedAttentionMetadata) -> bool:
        """True for a step of ``batch`` sequences, one new token each, that a bucket holds."""
        return (self.graphs.fits(batch)
                and meta.positions.shape[0] == meta.seq_lens.shape[0] == batch
                and meta.page_table.shape[1] <= self.max_pages_per_seq
                and meta.page_size == self.page_size)

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
            rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``step``'s output for a decode-only step (its first ``B`` rows, a copy); the caches
        are written exactly as by an eager step."""
        batch = int(input_ids.shape[0])
        if not self.fits(batch, meta):
            raise ValueError(f"a step of {batch} tokens does not fit buckets {self.graphs.batch_sizes} "
                             f"(or its metadata is not decode-only within {self.max_pages_per_seq} pages)")
        inputs = {"input_ids": input_ids, "positions": meta.positions, "slot_mapping": meta.slot_mapping,
                  "seq_lens": meta.seq_lens, "page_table": meta.page_table} | (rows or {})
        return self.graphs.run(batch, inputs)

    def _step(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a graph records: ``step`` over the first ``bucket`` rows of the buffers."""
        bucket = rows["input_ids"].shape[0]
        meta = PagedAttentionMetadata(
            positions=rows["positions"],
            slot_mapping=rows["slot_mapping"],
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=rows["seq_lens"],
            page_table=rows["page_table"],
            page_size=self.page_size,
            backend=self.backend,
        )
        return self.step(rows["input_ids"], meta, {name: rows[name] for name in self.row_pads})


class PrefillGraphs:
    """A fresh prefill of one sequence (its ``T`` prompt tokens at positions ``0 .. T - 1``, no
    cached prefix) replayed per token bucket of ``token_sizes``: ``step(input_ids, meta, last)``
    over static buffers, ``last`` ``[1]`` the index of the last real token, whose logits the
    step returns. The prompt fills the first ``T`` rows; the rows up to the bucket are token 0
    whose K/V go to the scratch page. The bucket's metadata says the sequence is ``bucket``
    long: a real token attends causally to positions up to its own, all real, so only padded
    tokens read the padded (or stale) keys past ``T``, and their outputs are dropped. The
    page table's columns past the prompt's pages hold the scratch page."""

    def __init__(self, step: Callable[[torch.Tensor, PagedAttentionMetadata, torch.Tensor], torch.Tensor],
                 *, device: torch.device, page_size: int, max_pages_per_seq: int, scratch_page: int,
                 token_sizes: Iterable[int] = DEFAULT_PREFILL_TOKENS, backend: str = "triton") -> None:
        if device.type == "cuda" and backend == "torch":
            raise ValueError("the 'torch' attention backend synchronises with the host and cannot be "
                             "captured in a CUDA graph; use 'triton'")
        sizes = sorted({int(n) for n in token_sizes})
        if not sizes or sizes[0] < 2:
            raise ValueError(f"prefill token buckets must be at least 2, got {sizes}")
        self.step, self.token_sizes = step, tuple(sizes)
        self.page_size, self.max_pages_per_seq, self.scratch_page = page_size, max_pages_per_seq, scratch_page
        self.backend, self.device = backend, device
        n = sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.page_table = torch.full((1, max_pages_per_seq), scratch_page, dtype=torch.int64, device=device)
        self.last = torch.zeros(1, dtype=torch.int64, device=device)
        self.positions = torch.arange(n, dtype=torch.int64, device=device)
        # padded token i writes its K/V to slot i of the scratch page (in turn)
        self.scratch_slots = scratch_page * page_size + self.positions % page_size
        # one metadata object a bucket, kept: the tensors a backend derives from it in the
        # warm-up runs (the prefill kernel's tiles) are the ones the capture records
        self.metas: dict[int, PagedAttentionMetadata] = {}
        self.runner = GraphRunner(self._step, device, warmups=2)

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def captured_token_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.runner.keys))

    def fits(self, tokens: int, meta: PagedAttentionMetadata) -> bool:
        """True for a step that is one sequence's whole prompt of ``tokens`` (2 to the last
        bucket) with no cached prefix."""
        return (1 < tokens <= self.max_tokens and meta.num_seqs == 1 and meta.seq_lens_list == [tokens]
                and meta.page_size == self.page_size and meta.page_table.shape[1] <= self.max_pages_per_seq)

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (nothing to do off CUDA)."""
        if self.runner.capture:
            with torch.inference_mode():
                for bucket in reversed(self.token_sizes):
                    if bucket not in self.runner:
                        self._prepare(bucket)

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """``step``'s output for the prompt (a copy); the prompt's K/V are written to its pages
        as by an eager step."""
        tokens = int(input_ids.shape[0])
        if not self.fits(tokens, meta):
            raise ValueError(f"a step of {tokens} tokens is not one fresh prompt within {self.max_tokens} tokens")
        bucket = next(size for size in self.token_sizes if size >= tokens)
        with torch.inference_mode():
            if bucket not in self.runner:
                self._prepare(bucket)
            self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
            self.input_ids[tokens:bucket].zero_()
            self.slot_mapping[:tokens].copy_(meta.slot_mapping, non_blocking=True)
            self.slot_mapping[tokens:bucket].copy_(self.scratch_slots[tokens:bucket])
            width = meta.page_table.shape[1]
            self.page_table[:, :width].copy_(meta.page_table, non_blocking=True)
            self.page_table[:, width:].fill_(self.scratch_page)
            self.last.fill_(tokens - 1)
            return self.runner.replay(bucket).clone()

    def _prepare(self, bucket: int) -> None:
        """Capture a bucket over an all-padding prompt (its writes go to the scratch page)."""
        self.input_ids[:bucket].zero_()
        self.slot_mapping[:bucket].copy_(self.scratch_slots[:bucket])
        self.page_table.fill_(self.scratch_page)
        self.last.fill_(bucket - 1)
        self.runner.prepare(bucket)

    def _step(self, bucket: int) -> torch.Tensor:
        meta = self.metas.get(bucket)
        if meta is None:
            meta = self.metas[bucket] = PagedAttentionMetadata(
                positions=self.positions[:bucket],
                slot_mapping=self.slot_mapping[:bucket],
                query_start_loc=torch.tensor([0, bucket], dtype=torch.int64, device=self.device),
                seq_lens=torch.tensor([bucket], dtype=torch.int64, device=self.device),
                page_table=self.page_table,
                page_size=self.page_size,
                backend=self.backend,
                host_query_start_loc=(0, bucket),
                host_seq_lens=(bucket,),
            )
        return self.step(self.input_ids[:bucket], meta, self.last)


class ShapeGraphs:
    """``fn(*inputs)`` replayed per key, the caller's (the inputs' shapes, and whatever
    Python-level choice changes the launched kernels): the first call of a key captures over
    static copies of its inputs, later calls copy their inputs in and replay. Past
    ``max_graphs`` keys ``fn`` runs eagerly. Each output is a copy."""

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.fn = fn
        self.max_graphs = max_graphs
        self.inputs: dict[Hashable, tuple[torch.Tensor, ...]] = {}
        # two warm-ups: the lazy initialisation of a first forward (cuBLAS workspaces, kernel
        # choice) stays out of the capture
        self.runner = GraphRunner(lambda key: fn(*self.inputs[key]), device, warmups=2)

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor:
        static = self.inputs.get(key)
        if static is None:
            if len(self.inputs) >= self.max_graphs:
                return self.fn(*inputs)
            self.inputs[key] = tuple(x.clone() for x in inputs)
            self.runner.prepare(key)
        else:
            for buffer, value in zip(static, inputs):
                buffer.copy_(value, non_blocking=True)
        return self.runner.replay(key).clone()
