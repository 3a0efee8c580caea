"""The autoregressive engine: paged KV cache, mixed prefill/decode batches, sampling, stops.

Every item of a plan for the node runs in ONE forward pass: prefills (op ``prefill``, input
port ``prompt_ids``) and decodes (op ``decode``, input port ``token``) of many requests
flattened together. The engine owns the node's KV pages (a torch-free ``PagePool``) and
the per-request token history; the conductor only admits requests against the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.page_pool import PagePool
from mstar.engine.sampler import Sampler
from mstar.engine.sampling_params import SamplingParams
from mstar.layers.attention import ATTENTION_BACKENDS, PagedAttentionMetadata, allocate_kv_cache

if TYPE_CHECKING:
    from mstar.engine.cuda_graphs import DecodeGraphRunner


class Decoder(Protocol):
    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    computed: int = 0  # tokens whose K/V are in the cache
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    max_new_tokens: int = 1 << 30
    stop_ids: frozenset[int] = frozenset()
    extra: dict[str, Any] = field(default_factory=dict)  # state of a model-specific engine

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class AutoregressiveEngine(Engine):
    """Request parameters it reads: ``sampling`` (SamplingParams fields), ``max_new_tokens``,
    ``stop_token_ids`` (EOS and friends; empty to ignore EOS).

    ``attention_backend`` names the paged-attention implementation put into every step's
    metadata (``"torch"`` reference or ``"triton"``). With a ``graph_runner``
    (``mstar.engine.cuda_graphs.DecodeGraphRunner``), decode-only steps it can run replay a
    CUDA graph for forward + logits; the last KV page is then reserved as its scratch page.
    """

    def __init__(self, model: Decoder, layout: KVLayout, *, num_pages: int, page_size: int,
                 max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 graph_runner: DecodeGraphRunner | None = None, attention_backend: str = "torch"):
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}")
        if graph_runner is not None and graph_runner.page_size != page_size:
            raise ValueError(f"graph runner page size {graph_runner.page_size} != {page_size}")
        self.model = model
        self.attention_backend = attention_backend
        self.graph_runner = graph_runner
        # The graph runner's padded rows write into one extra page past the pool's, so the
        # pool still holds the num_pages the conductor admits against.
        self.pool = PagePool(num_pages, page_size)
        self.max_seq_len = max_seq_len
        self.device = device
        cache_pages = num_pages + 1 if graph_runner is not None else num_pages
        self.kv_caches = allocate_kv_cache(layout.num_layers, cache_pages, page_size, layout.num_kv_heads,
                                           layout.head_dim, dtype, device)
        if graph_runner is not None:
            graph_runner.bind_kv_caches(self.kv_caches)
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ steps
    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        fresh = [item.request_id for item in items if item.request_id not in self.seqs]
        try:
            return self._run(items)
        except BaseException:
            for request_id in fresh:  # undo, so the worker can retry each item alone
                self.release(request_id)
            raise

    def _run(self, items: list[EngineItem]) -> list[EngineOutput]:
        seqs = [self._admit(item) for item in items]
        for item, seq in zip(items, seqs):
            self.pool.reserve(item.request_id, len(seq.tokens))
        with torch.inference_mode():
            meta, input_ids = self._metadata(items, seqs)
            if self._graph_runs(items, meta):
                assert self.graph_runner is not None
                logits = self.graph_runner.run(input_ids, meta)
            else:
                hidden = self.forward(input_ids, meta, items)
                last_rows = meta.query_start_loc[1:] - 1
                logits = self.model.compute_logits(hidden[last_rows])
            next_ids = self.choose(logits, seqs)
        return [self._advance(seq, token) for seq, token in zip(seqs, next_ids)]

    # Hooks a model-specific engine may override (an encoder-decoder adds cross-attention
    # state; a speech recogniser constrains which tokens may come next).
    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, items: list[EngineItem]) -> torch.Tensor:
        return self.model.forward(input_ids, meta, self.kv_caches)

    def _graph_runs(self, items: list[EngineItem], meta: PagedAttentionMetadata) -> bool:
        """Whether the graph runner takes this step (never when a subclass hooks ``forward``)."""
        return (self.graph_runner is not None
                and type(self).forward is AutoregressiveEngine.forward
                and self.graph_runner.can_run(items, meta))

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        """What a step writes: the sampled token (a subclass may add derived outputs)."""
        return {"token": torch.tensor([token], dtype=torch.int64)}

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.sampler(
            logits,
            [s.sampling for s in seqs],
            [s.generator for s in seqs],
            [s.tokens for s in seqs] if any(s.sampling.repetition_penalty != 1.0 for s in seqs) else None,
        ).tolist()

    def _admit(self, item: EngineItem) -> Sequence:
        seq = self.seqs.get(item.request_id)
        if item.op == "prefill":
            if seq is not None:
                raise RuntimeError(f"request {item.request_id} is prefilled twice")
            prompt = [int(t) for t in item.inputs["prompt_ids"].reshape(-1).tolist()]
            if not prompt:
                raise ValueError("empty prompt")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len {self.max_seq_len}")
            seq = self.seqs[item.request_id] = self._new_sequence(prompt, item.params)
            seq.extra["request_id"] = item.request_id
        elif item.op == "decode":
            if seq is None:
                raise RuntimeError(f"request {item.request_id} decodes before its prefill")
            token = int(item.inputs["token"].reshape(-1)[0])
            if seq.tokens[-1] != token or seq.computed != len(seq.tokens) - 1:
                raise RuntimeError(f"request {item.request_id}: decode input does not follow its history")
        else:
            raise ValueError(f"autoregressive engine has no op {item.op!r}")
        return seq

    def _new_sequence(self, prompt: list[int], params: dict[str, Any]) -> Sequence:
        sampling = SamplingParams(**params.get("sampling", {}))
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed)
        return Sequence(
            tokens=prompt,
            prompt_len=len(prompt),
            sampling=sampling,
            generator=generator,
            max_new_tokens=int(params.get("max_new_tokens", 1 << 30)),
            stop_ids=frozenset(int(t) for t in params.get("stop_token_ids", ())),
        )

    def _metadata(self, items: list[EngineItem], seqs: list[Sequence]) -> tuple[PagedAttentionMetadata, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for item, seq in zip(items, seqs):
            start, end = seq.computed, len(seq.tokens)
            input_ids += seq.tokens[start:end]
            positions += range(start, end)
            slots += self.pool.slots(item.request_id, start, end)
            starts.append(starts[-1] + end - start)
            seq_lens.append(end)
            tables.append(self.pool.page_table(item.request_id))
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int64)
        for row, pages in enumerate(tables):
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        meta = PagedAttentionMetadata(
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(seq_lens),
            page_table=table.to(self.device),
            page_size=self.pool.page_size,
            backend=self.attention_backend,
        )
        return meta, as_tensor(input_ids)

    def _advance(self, seq: Sequence, token: int) -> EngineOutput:
        seq.computed = len(seq.tokens)
        seq.tokens.append(token)
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        elif seq.generated >= seq.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            reason = "length"
        out = self.outputs(seq, token)
        if reason is None:
            return EngineOutput(out)
        return EngineOutput(out, ("stop",), reason)

    # -------------------------------------------------------------- resources
    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.pool.free(request_id)

    def stats(self) -> dict[str, float]:
        return {"kv_pages_used": self.pool.num_used_pages, "kv_pages_total": self.pool.num_pages,
                "sequences": len(self.seqs)}
