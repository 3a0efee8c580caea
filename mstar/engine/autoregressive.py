"""The autoregressive engine: paged KV cache, mixed prefill/decode batches, sampling, stops.

Every item of a plan for the node runs in ONE forward pass: prefills (op ``prefill``, input
port ``prompt_ids``) and decodes (op ``decode``, input port ``token``) of many requests
flattened together. The engine owns the node's KV pages (a torch-free ``PagePool``) and
the per-request token history; the conductor only admits requests against the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mstar.contract import SamplingParams
from mstar.distributed import broadcast, current_parallel
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.page_pool import PagePool
from mstar.engine.sampler import Sampler
from mstar.layers.paged_kv import (
    ATTENTION_BACKENDS,
    PagedAttentionMetadata,
    allocate_kv_cache,
)

if TYPE_CHECKING:
    from mstar.engine.cuda_graphs import DecodeGraphRunner


# (hook, the hook a subclass overriding it must also override to take part in overlap scheduling)
_AHEAD_HOOKS = (("forward", "decode_logits"), ("choose", "choose_on_device"))


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
    # The ``token`` output of its last step: the next decode's input is normally this very
    # tensor (the worker's store hands it back), which then needs no reading to be checked.
    written: torch.Tensor | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class _Ahead:
    """A decode step launched before the host knew its sequences continue (overlap
    scheduling): its input tokens came straight from the previous step on the device."""

    rows: dict[str, int]  # request id -> row of ``tokens``
    tokens: torch.Tensor  # [B] the ids it sampled, on the device, not yet read by the host


class AutoregressiveEngine(Engine):
    """Request parameters it reads: ``sampling`` (SamplingParams fields), ``max_new_tokens``,
    ``stop_token_ids`` (EOS and friends; empty to ignore EOS).

    ``attention_backend`` names the paged-attention implementation put into every step's
    metadata (``"torch"`` reference or ``"triton"``). With a ``graph_runner``
    (``mstar.engine.cuda_graphs.DecodeGraphRunner``), decode-only steps it can run replay a
    CUDA graph for forward + logits; the last KV page is then reserved as its scratch page.

    ``overlap_scheduling``: after launching a step, and before reading its tokens back, the
    engine launches the next decode step of every sequence that may continue, fed by the
    sampled ids still on the device. The device works on step k+1 while the host finishes
    step k (results, the conductor's next plan); when that plan comes, its decodes are
    already running. A sequence the plan leaves out (it stopped) has the extra step
    discarded and its pages rolled back. Eager, one step per plan, is the reference.
    """

    def __init__(self, model: Decoder, layout: KVLayout, *, num_pages: int, page_size: int,
                 max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 graph_runner: DecodeGraphRunner | None = None, attention_backend: str = "torch",
                 overlap_scheduling: bool = False):
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}")
        if graph_runner is not None and graph_runner.page_size != page_size:
            raise ValueError(f"graph runner page size {graph_runner.page_size} != {page_size}")
        if overlap_scheduling:
            bypassed = [f"{hook} without {ahead}" for hook, ahead in _AHEAD_HOOKS
                        if getattr(type(self), hook) is not getattr(AutoregressiveEngine, hook)
                        and getattr(type(self), ahead) is getattr(AutoregressiveEngine, ahead)]
            if bypassed:
                raise ValueError(f"overlap_scheduling: {type(self).__name__} hooks {', '.join(bypassed)}, "
                                 "which the steps launched ahead would bypass")
        self.model = model
        self.attention_backend = attention_backend
        self.graph_runner = graph_runner
        self.overlap = overlap_scheduling
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
        self.tp_group = current_parallel().tp  # the model's TP ranks must continue the same ids
        self.seqs: dict[str, Sequence] = {}
        self._ahead: _Ahead | None = None

    # ------------------------------------------------------------------ steps
    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        fresh = [item.request_id for item in items if item.request_id not in self.seqs]
        try:
            return self._run(items) if self.overlap else self._run_eager(items)
        except BaseException:
            self._drop_ahead()
            for item in items:  # pages reserved for a step that did not complete
                self._roll_back(item.request_id)
            for request_id in fresh:  # undo, so the worker can retry each item alone
                self.release(request_id)
            raise

    def _run_eager(self, items: list[EngineItem]) -> list[EngineOutput]:
        """The reference: one step per plan, its tokens read back before ``run`` returns."""
        seqs = [self._admit(item) for item in items]
        with torch.inference_mode():
            logits = self._logits(items, seqs)
            next_ids = self.choose(logits, seqs)
        values = self._token_values(torch.tensor(next_ids, dtype=torch.int64))
        return [self._advance(seq, token, value) for seq, token, value in zip(seqs, next_ids, values)]

    def _run(self, items: list[EngineItem]) -> list[EngineOutput]:
        """Overlapped: decodes launched ahead by the previous plan are taken as they are; the
        rest run now; then the next step is launched before this one's tokens are read."""
        ahead, self._ahead = self._ahead, None
        covered = self._take_ahead(ahead, items)
        seqs = [self._admit(item) for item in items]
        rest = [i for i in range(len(items)) if i not in covered]
        order = list(covered) + rest  # rows of next_ids, as plan indices
        with torch.inference_mode():
            parts = []
            if covered:
                rows = list(covered.values())
                parts.append(ahead.tokens if rows == list(range(len(ahead.tokens))) else
                             ahead.tokens[self._to_device(torch.tensor(rows, dtype=torch.int64))])
            if rest:
                chosen = [seqs[i] for i in rest]
                parts.append(self.choose_on_device(self._logits([items[i] for i in rest], chosen), chosen))
            next_ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            host, copied = self._fetch(next_ids)
            self._launch_ahead([items[i] for i in order], [seqs[i] for i in order], next_ids)
            if copied is not None:
                copied.synchronize()
            tokens = host.tolist()
        values = self._token_values(host)
        outputs: list[EngineOutput | None] = [None] * len(items)
        for row, i in enumerate(order):
            outputs[i] = self._advance(seqs[i], tokens[row], values[row])
        return outputs  # type: ignore[return-value]

    def _logits(self, items: list[EngineItem], seqs: list[Sequence]) -> torch.Tensor:
        """Reserve the pages of the items' new tokens, run them, and return each sequence's
        last-position logits ``[B, V]``."""
        for item, seq in zip(items, seqs):
            self.pool.reserve(item.request_id, len(seq.tokens))
        spans = [(item.request_id, seq.computed, len(seq.tokens)) for item, seq in zip(items, seqs)]
        input_ids = [t for seq in seqs for t in seq.tokens[seq.computed:]]
        meta, ids = self._metadata(spans, input_ids)
        if self._graph_runs(items, meta):
            assert self.graph_runner is not None
            return self.graph_runner.run(ids, meta)
        hidden = self.forward(ids, meta, items)
        if len(input_ids) == len(items):  # one new token per sequence: every row is a last one
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])

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
        return self._sample(logits, seqs).tolist()

    # The hooks of overlap scheduling: a subclass hooking ``forward`` or ``choose`` takes part
    # by hooking these too (``_AHEAD_HOOKS``).
    def decode_logits(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                      items: list[EngineItem]) -> torch.Tensor:
        """Logits ``[B, V]`` of a decode-only step (one new token per item, the sequences' host
        state one token behind): the step launched ahead."""
        if self.graph_runner is not None and self.graph_runner.fits(len(items), meta):
            return self.graph_runner.run(input_ids, meta)
        return self.model.compute_logits(self.model.forward(input_ids, meta, self.kv_caches))

    def choose_on_device(self, logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
        """``choose`` left on the logits' device, with the same ids. ``lead`` is how many tokens
        the step is ahead of the sequences' host state (1 for a step launched ahead: only
        sequences ``_continues`` accepted, whose next choice needs nothing from the host)."""
        return self._sample(logits, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The next id of every row, left on the logits' device."""
        penalised = any(s.sampling.repetition_penalty != 1.0 for s in seqs)
        ids = self.sampler(logits, [s.sampling for s in seqs], [s.generator for s in seqs],
                           [s.tokens for s in seqs] if penalised else None)
        return broadcast(ids, self.tp_group)  # unseeded draws differ per rank: take the first rank's

    # ---------------------------------------------------------- overlap ahead
    def _take_ahead(self, ahead: _Ahead | None, items: list[EngineItem]) -> dict[int, int]:
        """Plan index -> row of ``ahead`` for the plan's decodes it already ran; the pages of
        the rows the plan leaves out (their sequences stopped) are rolled back."""
        if ahead is None:
            return {}
        covered = {i: ahead.rows[item.request_id] for i, item in enumerate(items)
                   if item.op == "decode" and item.request_id in ahead.rows}
        taken = {items[i].request_id for i in covered}
        for request_id in ahead.rows.keys() - taken:
            self._roll_back(request_id)
        return covered

    def _continues(self, seq: Sequence) -> bool:
        """Whether a sequence, one token longer than it is now, may take another step:
        not at its length limits, and sampled without state the host must see first (a
        repetition penalty reads the unknown token; a seeded generator must not draw for
        a step that may be discarded; greedy rows never draw, seed or not)."""
        return (seq.generated + 1 < seq.max_new_tokens and len(seq.tokens) + 1 < self.max_seq_len
                and seq.sampling.repetition_penalty == 1.0 and (seq.generator is None or seq.sampling.greedy))

    def _launch_ahead(self, items: list[EngineItem], seqs: list[Sequence], next_ids: torch.Tensor) -> None:
        """Launch the decode step after this one for every sequence that may continue, its
        input the ids just sampled (``next_ids``, row per item, still on the device)."""
        rows = [row for row, seq in enumerate(seqs) if self._continues(seq)]
        rows = [row for row in rows if self.pool.can_reserve(items[row].request_id, len(seqs[row].tokens) + 1)]
        if not rows:
            return
        spans = []
        for row in rows:
            length = len(seqs[row].tokens) + 1  # the token being read back now, then one more
            self.pool.reserve(items[row].request_id, length)
            spans.append((items[row].request_id, length - 1, length))
        ids = next_ids if len(rows) == len(seqs) else next_ids[self._to_device(torch.tensor(rows))]
        meta, _ = self._metadata(spans, [])
        chosen = [seqs[row] for row in rows]
        logits = self.decode_logits(ids, meta, [items[row] for row in rows])
        self._ahead = _Ahead({items[row].request_id: i for i, row in enumerate(rows)},
                             self.choose_on_device(logits, chosen, lead=1))

    def _roll_back(self, request_id: str) -> None:
        """Give back pages reserved past the sequence's known tokens (a step launched ahead)."""
        seq = self.seqs.get(request_id)
        if seq is not None and self.pool.has(request_id) and self.pool.seq_len(request_id) > len(seq.tokens):
            self.pool.truncate(request_id, len(seq.tokens))

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            for request_id in self._ahead.rows:
                self._roll_back(request_id)
            self._ahead = None

    def _fetch(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``tokens`` to the host; the event marks when the copy is done."""
        if tokens.device.type != "cuda":
            return tokens.cpu(), None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    # ---------------------------------------------------------------- metadata
    def _admit(self, item: EngineItem) -> Sequence:
        seq = self.seqs.get(item.request_id)
        if item.op == "prefill":
            if seq is not None:
                raise RuntimeError(f"request {item.request_id} is prefilled twice")
            prompt = item.inputs["prompt_ids"].reshape(-1).tolist()
            if not prompt:
                raise ValueError("empty prompt")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len {self.max_seq_len}")
            seq = self.seqs[item.request_id] = self._new_sequence(prompt, item.params)
            seq.extra["request_id"] = item.request_id
        elif item.op == "decode":
            if seq is None and "kv" in item.inputs:  # first contact: another engine prefilled it
                seq = self._adopt(item)
            if seq is None:
                raise RuntimeError(f"request {item.request_id} decodes before its prefill")
            token = item.inputs["token"]
            if seq.computed != len(seq.tokens) - 1 or (token is not seq.written and _first_id(token) != seq.tokens[-1]):
                raise RuntimeError(f"request {item.request_id}: decode input does not follow its history")
        else:
            raise ValueError(f"autoregressive engine has no op {item.op!r}")
        return seq

    def _adopt(self, item: EngineItem) -> Sequence:
        """The sequence of a request another engine prefilled (a ``PrefillEngine``), rebuilt
        from its first decode's inputs: the prompt, the first token, the prompt's K/V and
        the sampler state after drawing that token."""
        prompt = item.inputs["prompt_ids"].reshape(-1).tolist()
        first = int(item.inputs["token"].reshape(-1)[0])
        return self.import_kv(item.request_id, item.inputs["kv"], prompt + [first], prompt_len=len(prompt),
                              params=item.params, generator_state=item.inputs.get("rng"))

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

    def _metadata(self, spans: list[tuple[str, int, int]],
                  input_ids: list[int]) -> tuple[PagedAttentionMetadata, torch.Tensor]:
        """The attention metadata of a step whose row ``r`` runs positions ``[start, end)`` of
        its sequence (``spans[r] = (request_id, start, end)``), and ``input_ids`` on the
        device. Host work is per row, never per token (a prefill's positions and slots come
        from whole-batch tensor ops), and everything reaches the device in one copy."""
        page_size = self.pool.page_size
        tables = self.pool.tables([request_id for request_id, _, _ in spans])
        width = max(len(t) for t in tables)
        batch = len(spans)
        lens = [end for _, _, end in spans]
        query_start_loc = [0, *itertools.accumulate(end - start for _, start, end in spans)]
        total = query_start_loc[-1]
        table = [page for t in tables for page in (t + [0] * (width - len(t)) if len(t) < width else t)]
        tail = query_start_loc + lens + input_ids + table
        if total == batch:  # one token per row (decodes): positions and slots per row
            positions = [start for _, start, _ in spans]
            slots = [t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions)]
            packed = torch.tensor(positions + slots + tail, dtype=torch.int64)
        else:
            starts = torch.tensor([start for _, start, _ in spans], dtype=torch.int64)
            host_table = torch.tensor(table, dtype=torch.int64).view(batch, width)
            counts = torch.tensor(lens, dtype=torch.int64) - starts
            row_of = torch.repeat_interleave(torch.arange(batch), counts)
            first = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
            positions_t = starts[row_of] + torch.arange(total) - first[row_of]
            slots_t = host_table[row_of, positions_t // page_size] * page_size + positions_t % page_size
            packed = torch.cat([positions_t, slots_t, torch.tensor(tail, dtype=torch.int64)])
        on_device = self._to_device(packed)
        sizes = [total, total, batch + 1, batch, len(input_ids), batch * width]
        positions_d, slots_d, qsl_d, lens_d, ids_d, table_d = on_device.split(sizes)
        meta = PagedAttentionMetadata(
            positions=positions_d,
            slot_mapping=slots_d,
            query_start_loc=qsl_d,
            seq_lens=lens_d,
            page_table=table_d.view(batch, width),
            page_size=page_size,
            backend=self.attention_backend,
        )
        return meta, ids_d

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device, copied without waiting for the device
        (pinned memory, non-blocking), so launching a step never stalls on the previous."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _token_values(self, tokens: torch.Tensor) -> list[torch.Tensor | None]:
        """Each row's ``token`` output as a ``[1]`` view of the step's ids (one op for the
        batch), when ``outputs`` is not hooked; else Nones (the hook builds them)."""
        if type(self).outputs is not AutoregressiveEngine.outputs:
            return [None] * tokens.shape[0]
        return list(tokens.view(-1, 1).unbind(0))

    def _advance(self, seq: Sequence, token: int, value: torch.Tensor | None = None) -> EngineOutput:
        seq.computed = len(seq.tokens)
        seq.tokens.append(token)
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        elif seq.generated >= seq.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            reason = "length"
        out = self.outputs(seq, token) if value is None else {"token": value}
        seq.written = out.get("token")
        if reason is None:
            return EngineOutput(out)
        return EngineOutput(out, ("stop",), reason)

    # -------------------------------------------------------------- resources
    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.pool.free(request_id)
        if self._ahead is not None:
            self._ahead.rows.pop(request_id, None)
            if not self._ahead.rows:
                self._ahead = None

    # ------------------------------------------------------- KV hand-off
    def export_kv(self, request_id: str) -> torch.Tensor:
        """The K/V of the sequence's computed positions, gathered from its pages into one
        tensor ``[layers, 2, tokens, kv_heads, head_dim]`` (a copy: its pages may be freed)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} holds no sequence to export")
        slots = self._to_device(torch.tensor(self.pool.slots(request_id, 0, seq.computed), dtype=torch.int64))
        return torch.stack([_flat_slots(cache).index_select(1, slots) for cache in self.kv_caches])

    def generator_state(self, request_id: str) -> torch.Tensor:
        """The request's sampler state (a seeded generator's bytes; empty when unseeded),
        so another engine continues the same random stream."""
        generator = self.seqs[request_id].generator
        return generator.get_state() if generator is not None else torch.empty(0, dtype=torch.uint8)

    def import_kv(self, request_id: str, kv: torch.Tensor, tokens: list[int], *, prompt_len: int,
                  params: dict[str, Any], generator_state: torch.Tensor | None = None) -> Sequence:
        """Adopt a request whose first ``kv.shape[2]`` positions another engine computed
        (``export_kv``): reserve their pages here, write the K/V into them, and continue
        from ``tokens`` (the whole history, the prompt its first ``prompt_len``) as if this
        engine had run those steps. ``params`` are the request's; ``generator_state``
        (``generator_state``) resumes a seeded sampler where the other engine left it."""
        if request_id in self.seqs:
            raise RuntimeError(f"request {request_id} already holds a sequence here")
        layers = len(self.kv_caches)
        heads, head_dim = self.kv_caches[0].shape[-2:]
        computed = kv.shape[2] if kv.dim() == 5 else -1
        if kv.dim() != 5 or tuple(kv.shape[:2]) != (layers, 2) or tuple(kv.shape[3:]) != (heads, head_dim):
            raise ValueError(f"request {request_id}: KV of shape {tuple(kv.shape)} does not fit this cache "
                             f"[{layers}, 2, tokens, {heads}, {head_dim}]")
        if not 0 < computed < len(tokens) or not 0 < prompt_len <= len(tokens):
            raise ValueError(f"request {request_id}: KV of {computed} positions, {len(tokens)} tokens and a "
                             f"prompt of {prompt_len} do not make a sequence that can continue")
        if len(tokens) >= self.max_seq_len:
            raise ValueError(f"request {request_id}: {len(tokens)} tokens do not fit max_seq_len {self.max_seq_len}")
        seq = self._new_sequence(list(tokens[:prompt_len]), params)
        seq.tokens.extend(tokens[prompt_len:])
        seq.computed = computed
        seq.extra["request_id"] = request_id
        if seq.generator is not None and generator_state is not None and generator_state.numel():
            seq.generator.set_state(generator_state.cpu())
        self.pool.reserve(request_id, computed)  # OutOfPages leaves the pool as it was
        try:
            slots = self._to_device(torch.tensor(self.pool.slots(request_id, 0, computed), dtype=torch.int64))
            for layer, cache in enumerate(self.kv_caches):
                _flat_slots(cache).index_copy_(1, slots, kv[layer].to(cache.device, cache.dtype))
        except BaseException:
            self.pool.free(request_id)
            raise
        self.seqs[request_id] = seq
        return seq

    def stats(self) -> dict[str, float]:
        return {"kv_pages_used": self.pool.num_used_pages, "kv_pages_total": self.pool.num_pages,
                "sequences": len(self.seqs)}


class PrefillEngine(AutoregressiveEngine):
    """The prefill half of a disaggregated LLM. It prefills each request, samples its first
    token, and hands the request off: besides ``token`` a step writes ``kv`` (the prompt's
    K/V, ``export_kv``) and ``rng`` (the sampler state, ``generator_state``), then frees the
    request's pages at once. The decode engine adopts the request on its first decode
    (``import_kv``). A request that ends at its first token hands nothing off (``kv`` and
    ``rng`` stay silent: no decode follows)."""

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op != "prefill":
                raise ValueError(f"a prefill engine has no op {item.op!r}")
        outputs = super().run(items)
        try:
            for item, out in zip(items, outputs):
                if "stop" not in out.flags:
                    out.outputs["kv"] = self.export_kv(item.request_id)
                    out.outputs["rng"] = self.generator_state(item.request_id)
        finally:
            for item in items:
                self.release(item.request_id)
        return outputs


def _first_id(token: torch.Tensor) -> int:
    """The id a decode's ``token`` input holds (its first element)."""
    return token.item() if token.numel() == 1 else int(token.reshape(-1)[0])


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[2, pages, page_size, H, D]`` viewed as ``[2, slots, H, D]``."""
    return cache.view(2, -1, cache.shape[-2], cache.shape[-1])
