"""The autoregressive engine: paged KV cache, mixed prefill/decode batches, sampling, stops.

Every item of a plan for the node runs in ONE forward pass: prefills (op ``prefill``, input
port ``prompt_ids``) and decodes (op ``decode``, input port ``token``) of many requests
flattened together. The engine owns the node's KV pages (a torch-free ``PagePool``) and
the per-request token history; the conductor only admits requests against the pool.

One engine serves every autoregressive model: it is specialised by what it is given, never by
subclassing. ``rules`` (``mstar.engine.rules.TokenRules``) choose the tokens and say what a
step writes; ``forward`` (``mstar.engine.forward.Forward``) runs the model over a step's
tokens, with any per-request state the model reads besides the KV cache.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from mstar.contract import SamplingParams
from mstar.distributed import broadcast, current_parallel
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, DEFAULT_PREFILL_TOKENS, DecodeGraphs, PrefillGraphs
from mstar.engine.forward import Decoder, Forward
from mstar.engine.page_pool import PagePool
from mstar.engine.rules import TokenRules
from mstar.engine.sampler import Sampler, SeenTokens
from mstar.engine.sequence import Sequence
from mstar.engine.window_pages import SlidingWindowPages
from mstar.layers.paged_kv import (
    ATTENTION_BACKENDS,
    PagedAttentionMetadata,
    allocate_kv_cache,
    int64_tensor,
    to_device,
)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    planes: int = 2  # keys and values; 1: one latent row per token (multi-head latent attention)
    # each layer's sliding window (None: it attends to every position); empty: none has one.
    # The sliding layers keep their K/V in a pool of their own, whose pages a sequence gives
    # back as its window leaves them behind (``mstar.engine.window_pages``)
    windows: tuple[int | None, ...] = ()

    @property
    def window(self) -> int | None:
        """The longest sliding window of any layer (None: no layer has one)."""
        return max((w for w in self.windows if w is not None), default=None)


@dataclass
class _Ahead:
    """A decode step launched before the host knew its sequences continue (overlap
    scheduling): its input tokens came straight from the previous step on the device."""

    rows: dict[str, int]  # request id -> row of ``tokens``
    tokens: torch.Tensor  # [B] the ids it sampled, on the device, not yet read by the host
    # request id -> its seeded generator's state before the step drew: a discarded row's
    # generator goes back to it, so it draws the same numbers when the step runs again
    drawn: dict[str, torch.Tensor]


class AutoregressiveEngine(Engine):
    """Request parameters it reads: ``sampling`` (SamplingParams fields), ``max_new_tokens``,
    ``stop_token_ids`` (EOS and friends; empty to ignore EOS), and whatever its ``rules`` read.

    ``rules`` (default: every token sampled, ``token`` written alone) and ``forward``
    (default: ``Forward(model)``, a plain decoder) specialise it to a model.

    ``attention_backend`` names the paged-attention implementation put into every step's
    metadata (``"torch"`` reference or ``"triton"``). ``cuda_graphs``: decode-only steps (one
    new token per row) replay a CUDA graph per batch bucket of ``graph_batch_sizes``
    (``self.graphs``, ``mstar.engine.cuda_graphs.DecodeGraphs``; captured on first use, or
    all at once by ``graphs.capture_all()``); the KV caches get one page more than the pool,
    the padded rows' scratch page. With the plain ``Forward``, a step that is one sequence's
    whole prompt (no cached prefix) of at most the last of ``prefill_graph_tokens`` tokens also
    replays a graph, per token bucket (``self.prefill_graphs``, ``PrefillGraphs``): time to
    first token at one stream is then the GPU's, not the host's. Off CUDA the same buckets run
    eagerly.

    ``overlap_scheduling``: after launching a step, and before reading its tokens back, the
    engine launches the next decode step of every sequence that may continue, fed by the
    sampled ids still on the device. The device works on step k+1 while the host finishes
    step k (results, the conductor's next plan); when that plan comes, its decodes are
    already running. A sequence the plan leaves out (it stopped) has the extra step
    discarded and its pages rolled back. Eager, one step per plan, is the reference.

    ``prefix_caching``: the whole pages of every sequence's computed tokens stay in the pool's
    prefix cache (``PagePool.register``), and a prefill whose only input is its token ids
    starts on the cached pages of its longest cached prefix (``PagePool.match_prefix``), so
    its step computes only the rest. At most all but the prompt's last token is taken from
    the cache: the step always computes a position (the logits come from it) and never
    writes into a shared page. Only for a forward whose K/V depend on the tokens alone
    (``Forward.kv_from_tokens``); ``stats`` counts the prompt tokens queried and found.

    Pages are reserved as sequences grow, not up front (``_make_room``). When a step's rows
    need more than are free, the sequences holding pages reserve first, oldest first, each
    taking the pages of the newest sequences that hold any (preempting them: their pages are
    freed and ``computed`` drops to 0; their tokens, rules state and sampler are kept, since
    nothing was drawn for them); a row that still does not fit waits with what it holds. Then
    the rows holding none (new prefills, preempted sequences) reserve in admission order,
    taking only free pages, until the first that does not fit. The rows that do not run give
    their item back (``EngineOutput(preempted=True)``) and the conductor sends it again; a
    preempted decode then runs its whole history as one span and samples the token it would
    have sampled. A forward that is not ``preemptible`` reserves plainly, and ``OutOfPages``
    fails the step (its requests must hold their pages from admission).

    ``max_prefill_tokens`` (None: no limit) bounds the tokens a step computes for the rows
    that start from no pages of their own (new prefills, less their cached prefix; preempted
    sequences): taken in admission order, the first whatever its length, then while the sum
    stays within it. The rest are given back unrun like the rows that find no pages. Decodes
    are not counted. It needs a ``preemptible`` forward.

    Sliding-window layers (``layout.windows``) keep their K/V in a pool of their own
    (``SlidingWindowPages``; ``window_pages`` pages, default ``num_pages``), and a sequence gives
    back the pages there that its window has passed while it runs; their layers read the
    step's ``meta.windowed``. Not yet with CUDA graphs, prefix caching or a KV hand-off.
    """

    def __init__(self, model: Decoder, layout: KVLayout, *, num_pages: int, page_size: int,
                 max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 rules: TokenRules | None = None, forward: Forward | None = None,
                 attention_backend: str = "torch", cuda_graphs: bool = False,
                 graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, overlap_scheduling: bool = False,
                 prefix_caching: bool = False, max_prefill_tokens: int | None = None,
                 prefill_graph_tokens: tuple[int, ...] = DEFAULT_PREFILL_TOKENS, window_pages: int | None = None):
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}")
        self.model = model
        self.rules = rules if rules is not None else TokenRules()
        self.forward = forward if forward is not None else Forward(model)
        if self.forward.model is not model:
            raise ValueError("the engine's forward runs another model than the engine's")
        name = type(self.forward).__name__
        if overlap_scheduling and not self.forward.runs_ahead:
            raise ValueError(f"overlap_scheduling: {name} keeps per-request state that a discarded step "
                             "launched ahead would leave advanced")
        if cuda_graphs and self.forward.graph_rows is None:
            raise ValueError(f"cuda_graphs: {name} cannot replay its decode steps from CUDA graphs")
        if prefix_caching and not self.forward.kv_from_tokens:
            raise ValueError(f"prefix_caching: the K/V {name} computes depend on more than the token ids")
        if max_prefill_tokens is not None and not self.forward.preemptible:
            raise ValueError(f"max_prefill_tokens: {name} cannot give a prefill back unrun")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.deferred = 0  # prefills given back because a step's prefill budget was spent (a gauge)
        self.attention_backend = attention_backend
        self.overlap = overlap_scheduling
        self.prefix_caching = prefix_caching
        self.prefix_queried = self.prefix_hits = 0  # prompt tokens looked up, and found, in the cache
        # With CUDA graphs the padded rows write into one extra page past the pool's, so the
        # pool still holds the num_pages the conductor admits against.
        self.windowed = layout.window is not None
        if self.windowed and (cuda_graphs or prefix_caching):
            raise ValueError("sliding-window layers: cuda_graphs and prefix_caching are not supported yet")
        self.pool: PagePool | SlidingWindowPages = (
            SlidingWindowPages(num_pages, page_size, layout.window, window_pages) if layout.window is not None
            else PagePool(num_pages, page_size))
        self.max_seq_len = max_seq_len
        # the most tokens one sequence's pages may hold: a decode asks ``_check_fits`` only past it
        self._pool_tokens = self.pool.num_pages * page_size
        self.device = device
        cache_pages = num_pages + 1 if cuda_graphs else num_pages
        if self.windowed:
            window_cache_pages = self.pool.windowed.num_pages
            self.kv_caches = [allocate_kv_cache(1, cache_pages if window is None else window_cache_pages, page_size,
                                                layout.num_kv_heads, layout.head_dim, dtype, device,
                                                planes=layout.planes)[0]
                              for window in layout.windows]
        else:
            self.kv_caches = allocate_kv_cache(layout.num_layers, cache_pages, page_size, layout.num_kv_heads,
                                               layout.head_dim, dtype, device, planes=layout.planes)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(
                lambda ids, meta, rows: self.forward.graph_step(ids, meta, self.kv_caches, rows),
                device=device, page_size=page_size, max_pages_per_seq=-(-max_seq_len // page_size),
                scratch_page=num_pages, batch_sizes=graph_batch_sizes, backend=attention_backend,
                row_pads=self.forward.graph_rows)
        # A fresh prompt of one sequence replays a prefill graph when the forward is the plain
        # one (its prefill reads nothing but the ids and the paged cache).
        self.prefill_graphs: PrefillGraphs | None = None
        plain = type(self.forward).prepare is Forward.prepare and type(self.forward).hidden is Forward.hidden
        if cuda_graphs and plain and prefill_graph_tokens:
            self.prefill_graphs = PrefillGraphs(
                self._prefill_graph_step, device=device, page_size=page_size,
                max_pages_per_seq=-(-max_seq_len // page_size), scratch_page=num_pages,
                token_sizes=[n for n in prefill_graph_tokens if n < max_seq_len], backend=attention_backend)
        self.sampler = Sampler()
        self.seen = SeenTokens()  # the repetition penalty's marks, kept on the device
        self.tp_group = current_parallel().tp  # the model's TP ranks must continue the same ids
        self.seqs: dict[str, Sequence] = {}
        self._orders = itertools.count()  # ``Sequence.order``: admission order
        self.preemptions = 0  # sequences preempted since start (a gauge in ``stats``)
        self._ahead: _Ahead | None = None
        self._forward_began = False  # in the step running now

    # ------------------------------------------------------------------ steps
    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        fresh = [item.request_id for item in items if item.request_id not in self.seqs]
        self._forward_began = False
        try:
            return self._run(items) if self.overlap else self._run_eager(items)
        except BaseException:
            self._drop_ahead()
            for item in items:  # pages reserved for a step that did not complete
                self._roll_back(item.request_id)
            if self._forward_began:
                self.forward.failed([item.request_id for item in items])
            for request_id in fresh:  # undo, so the worker can retry each item alone
                self.release(request_id)
            raise

    def _run_eager(self, items: list[EngineItem]) -> list[EngineOutput]:
        """The reference: one step per plan, its tokens read back before ``run`` returns."""
        seqs = [self._admit(item) for item in items]
        runs = self._make_room(items, seqs, list(range(len(items))))
        if not runs:
            return [EngineOutput(preempted=True) for _ in items]
        chosen = [seqs[i] for i in runs]
        with torch.inference_mode():
            next_ids = self.rules.choose(self._logits([items[i] for i in runs], chosen), chosen, self.sample)
            host = next_ids.cpu()
        tokens = host.tolist()
        values = host.view(-1, 1).unbind(0)
        if len(runs) == len(items):  # every row ran (runs is in plan order)
            return [self._advance(seq, token, value) for seq, token, value in zip(seqs, tokens, values)]
        outputs = [EngineOutput(preempted=True) for _ in items]
        for row, i in enumerate(runs):
            outputs[i] = self._advance(seqs[i], tokens[row], values[row])
        return outputs

    def _run(self, items: list[EngineItem]) -> list[EngineOutput]:
        """Overlapped: decodes launched ahead by the previous plan are taken as they are; the
        rest run now; then the next step is launched before this one's tokens are read."""
        ahead, self._ahead = self._ahead, None
        covered = self._take_ahead(ahead, items)
        seqs = [self._admit(item) for item in items]
        rest = [i for i in range(len(items)) if i not in covered]
        if covered and self._pages_wanted([items[i] for i in rest], [seqs[i] for i in rest]) > self.pool.num_free_pages:
            for i in covered:  # the rest may preempt: the step ahead is discarded and its rows run again
                self._discard(ahead, items[i].request_id)
            covered, rest = {}, list(range(len(items)))
        rest = self._make_room(items, seqs, rest)
        order = list(covered) + rest  # rows of next_ids, as plan indices
        outputs: list[EngineOutput] = [EngineOutput(preempted=True) for _ in items]
        if not order:
            return outputs
        with torch.inference_mode():
            parts = []
            if covered:
                rows = list(covered.values())
                parts.append(ahead.tokens if rows == list(range(len(ahead.tokens))) else
                             ahead.tokens[self._to_device(torch.tensor(rows, dtype=torch.int64))])
            if rest:
                chosen = [seqs[i] for i in rest]
                parts.append(self.rules.choose(self._logits([items[i] for i in rest], chosen), chosen, self.sample))
            next_ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            host, copied = self._fetch(next_ids)
            self._launch_ahead([items[i] for i in order], [seqs[i] for i in order], next_ids)
            if copied is not None:
                copied.synchronize()
            tokens = host.tolist()
        values = host.view(-1, 1).unbind(0)
        for row, i in enumerate(order):
            outputs[i] = self._advance(seqs[i], tokens[row], values[row])
        return outputs

    # ------------------------------------------------------------------ pages
    def _make_room(self, items: list[EngineItem], seqs: list[Sequence], rows: list[int]) -> list[int]:
        """Reserve the pages of the new tokens of ``rows`` (plan indices), preempting as the
        class doc says; the rows that run now, in plan order."""
        # The steady case first: rows that all hold pages grow together when the free pages
        # cover them all (``PagePool.grow``), which is what the rest would decide row by row
        # (every decode holding pages reserves, oldest first, and none is short of pages).
        grows = type(self.pool) is PagePool and all(items[i].op == "decode" for i in rows)
        if grows and self.pool.grow([items[i].request_id for i in rows], [len(seqs[i].tokens) for i in rows]):
            return rows
        if not self.forward.preemptible:
            for i in rows:
                self.pool.reserve(items[i].request_id, len(seqs[i].tokens))
            return rows
        by_age = sorted(rows, key=lambda i: seqs[i].order)
        # Running decodes hold pages of their own; a prefill may hold cached prefix pages, but it
        # starts this step, so it takes its new pages in admission order with the preempted.
        holding = [i for i in by_age if items[i].op == "decode" and self.pool.has(items[i].request_id)]
        runs: list[int] = []
        victims: list[Sequence] | None = None  # the sequences holding pages, newest last
        for i in holding:
            seq, request_id = seqs[i], items[i].request_id
            while self.pool.has(request_id) and not self.pool.can_reserve(request_id, len(seq.tokens)):
                if victims is None:
                    victims = sorted((s for s in self.seqs.values() if self.pool.has(s.request_id)),
                                     key=lambda s: s.order)
                while victims and not self.pool.has(victims[-1].request_id):
                    victims.pop()
                if not victims or victims[-1].order <= seq.order:
                    break  # nothing newer to take from: it waits, keeping what it holds
                self._preempt(victims.pop())
            else:
                if self.pool.has(request_id):  # else preempted this step for an older row
                    self.pool.reserve(request_id, len(seq.tokens))
                    runs.append(i)
        spent = 0  # new tokens of the rows taken below (max_prefill_tokens)
        held = set(holding)
        for i in by_age:
            if i in held:
                continue
            new = len(seqs[i].tokens) - seqs[i].computed
            if spent and self.max_prefill_tokens is not None and spent + new > self.max_prefill_tokens:
                self.deferred += sum(1 for j in by_age[by_age.index(i):] if j not in held)
                break  # the step's prefill budget is spent: the newer ones come again next step
            if not self.pool.can_reserve(items[i].request_id, len(seqs[i].tokens)):
                break  # first come, first served: the newer ones wait too
            self.pool.reserve(items[i].request_id, len(seqs[i].tokens))
            runs.append(i)
            spent += new
        ran = set(runs)
        for i in rows:  # a prefill that did not run is taken in afresh when it comes again
            if i not in ran and items[i].op == "prefill":
                self.seqs.pop(items[i].request_id, None)
                self.pool.free(items[i].request_id)
        return sorted(runs)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages; its next step recomputes it from position 0."""
        self.pool.free(seq.request_id)
        seq.computed = 0
        self.preemptions += 1

    def _pages_wanted(self, items: list[EngineItem], seqs: list[Sequence]) -> int:
        """Pages the items' new tokens need beyond what their sequences hold."""
        return sum(self.pool.pages_missing(item.request_id, len(seq.tokens)) for item, seq in zip(items, seqs))

    def _logits(self, items: list[EngineItem], seqs: list[Sequence]) -> torch.Tensor:
        """Run the items' new tokens (their pages reserved) and return each sequence's
        last-position logits ``[B, V]``."""
        spans = [(item.request_id, seq.computed, len(seq.tokens)) for item, seq in zip(items, seqs)]
        input_ids = [t for seq in seqs for t in seq.tokens[seq.computed:]]
        meta, ids = self._metadata(spans, input_ids)
        counts = None if len(input_ids) == len(items) else [end - start for _, start, end in spans]
        return self._forward_logits(ids, meta, items, counts)

    def _forward_logits(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, items: list[EngineItem],
                        counts: list[int] | None) -> torch.Tensor:
        """The last-position logits ``[B, V]`` of a step whose item ``b`` has ``counts[b]`` new
        tokens (None: one each, a decode-only step, which the CUDA graphs may replay)."""
        inputs = self.forward.prepare(items, input_ids, meta, counts)
        self._forward_began = True
        if counts is None and self.graphs is not None and self.graphs.fits(len(items), meta):
            return self.forward.graph_logits(self.graphs.run(input_ids, meta, inputs))
        if counts is not None and self.prefill_graphs is not None and self.prefill_graphs.fits(counts[0], meta):
            return self.prefill_graphs.run(input_ids, meta)
        hidden = self.forward.hidden(input_ids, meta, self.kv_caches, inputs, counts)
        return self.forward.logits(hidden if counts is None else hidden[meta.query_start_loc[1:] - 1])

    def _prefill_graph_step(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                            last: torch.Tensor) -> torch.Tensor:
        """What a prefill graph records: the logits ``[1, V]`` of the prompt's row ``last``."""
        hidden = self.forward.hidden(input_ids, meta, self.kv_caches, {}, [int(input_ids.shape[0])])
        return self.forward.logits(hidden.index_select(0, last))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None) -> torch.Tensor:
        """The next id of every row, left on the logits' device (the rules' ``sample``).
        ``pending``: for a step launched ahead, each row's id the host has not read yet."""
        keys = [s.request_id if s.sampling.repetition_penalty != 1.0 else None for s in seqs]
        seen = None
        if any(key is not None for key in keys):
            seen = self.seen.mask(keys, [s.tokens for s in seqs], logits.shape[-1], logits.device, pending)
        ids = self.sampler(logits, [s.sampling for s in seqs], [s.generator for s in seqs], seen)
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
            self._discard(ahead, request_id)
        return covered

    def _continues(self, seq: Sequence) -> bool:
        """Whether a sequence, one token longer than it is now, may take another step:
        not at its length limits, and its rules' next choice needs nothing from the host. (A
        repetition penalty marks the unread token on the device; a seeded generator that
        draws for the step is put back if the step is discarded, ``_Ahead.drawn``.)"""
        return (seq.generated + 1 < seq.max_new_tokens and len(seq.tokens) + 1 < self.max_seq_len
                and self.rules.may_run_ahead(seq))

    def _launch_ahead(self, items: list[EngineItem], seqs: list[Sequence], next_ids: torch.Tensor) -> None:
        """Launch the decode step after this one for every sequence that may continue, its
        input the ids just sampled (``next_ids``, row per item, still on the device)."""
        rows, spans = [], []
        for row, seq in enumerate(seqs):  # the rows that continue, while their pages fit
            length = len(seq.tokens) + 1  # the token being read back now, then one more
            if self._continues(seq) and self.pool.can_reserve(items[row].request_id, length):
                self.pool.reserve(items[row].request_id, length)
                rows.append(row)
                spans.append((items[row].request_id, length - 1, length))
        if not rows:
            return
        ids = next_ids if len(rows) == len(seqs) else next_ids[self._to_device(torch.tensor(rows))]
        meta, _ = self._metadata(spans, [])
        chosen = [seqs[row] for row in rows]
        drawn = {seq.request_id: seq.generator.get_state() for seq in chosen
                 if seq.generator is not None and not seq.sampling.greedy}
        logits = self._forward_logits(ids, meta, [items[row] for row in rows], None)
        sample = functools.partial(self.sample, pending=ids)  # the ids this step reads are not in the seqs yet
        self._ahead = _Ahead({items[row].request_id: i for i, row in enumerate(rows)},
                             self.rules.choose(logits, chosen, sample, lead=1), drawn)

    def _roll_back(self, request_id: str) -> None:
        """Give back pages reserved past the sequence's known tokens (a step launched ahead)."""
        seq = self.seqs.get(request_id)
        if seq is not None and self.pool.has(request_id) and self.pool.seq_len(request_id) > len(seq.tokens):
            self.pool.truncate(request_id, len(seq.tokens))

    def _discard(self, ahead: _Ahead, request_id: str) -> None:
        """Undo the step ahead for one of its rows: pages rolled back, generator put back."""
        self._roll_back(request_id)
        state, seq = ahead.drawn.get(request_id), self.seqs.get(request_id)
        if state is not None and seq is not None:
            seq.generator.set_state(state)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            for request_id in self._ahead.rows:
                self._discard(self._ahead, request_id)
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
            self._check_fits(item.request_id, len(prompt))
            seq = self.seqs[item.request_id] = self._new_sequence(item.request_id, prompt, item.params)
            if self.prefix_caching and item.inputs.keys() == {"prompt_ids"}:  # media would add to the K/V
                seq.computed = self._share_prefix(item.request_id, prompt)
        elif item.op == "decode":
            if seq is None and "kv" in item.inputs:  # first contact: another engine prefilled it
                seq = self._adopt(item)
            if seq is None:
                raise RuntimeError(f"request {item.request_id} decodes before its prefill")
            token = item.inputs["token"]
            preempted = seq.computed == 0 and not self.pool.has(item.request_id)  # it recomputes its history
            if (seq.computed != len(seq.tokens) - 1 and not preempted) or (
                    token is not seq.written and _first_id(token) != seq.tokens[-1]):
                raise RuntimeError(f"request {item.request_id}: decode input does not follow its history")
            if len(seq.tokens) > self._pool_tokens:
                self._check_fits(item.request_id, len(seq.tokens))
        else:
            raise ValueError(f"autoregressive engine has no op {item.op!r}")
        return seq

    def _share_prefix(self, request_id: str, prompt: list[int]) -> int:
        """Start the request's pages on the cached pages of its prompt's longest cached prefix
        of whole pages, its last token left out; returns how many tokens they hold."""
        pages = self.pool.match_prefix(prompt[:-1])
        self.pool.attach(request_id, pages)
        found = len(pages) * self.pool.page_size
        self.prefix_queried += len(prompt)
        self.prefix_hits += found
        return found

    def _check_fits(self, request_id: str, num_tokens: int) -> None:
        """A sequence the whole pool cannot hold fails, rather than wait for pages forever (the
        runtime refuses such requests at admission: ``WalkRequest.peak``)."""
        if self.pool.pages_needed(num_tokens) > self.pool.num_pages:
            raise ValueError(f"request {request_id}: {num_tokens} tokens need {self.pool.pages_needed(num_tokens)} "
                             f"KV pages, and the whole pool holds {self.pool.num_pages}")

    def _adopt(self, item: EngineItem) -> Sequence:
        """The sequence of a request another engine prefilled (a ``PrefillEngine``), rebuilt
        from its first decode's inputs: the prompt, the first token, the prompt's K/V and
        the sampler state after drawing that token."""
        prompt = item.inputs["prompt_ids"].reshape(-1).tolist()
        first = int(item.inputs["token"].reshape(-1)[0])
        kv = item.inputs["kv"]
        if self.forward.preemptible and not self.pool.can_reserve(item.request_id, kv.shape[2] if kv.dim() == 5 else 0):
            # No room for its K/V now: adopted as if preempted, its history recomputed when it runs.
            seq = self._new_sequence(item.request_id, prompt, item.params)
            seq.tokens.append(first)
            _restore_generator(seq, item.inputs.get("rng"))
            self.seqs[item.request_id] = seq
            return seq
        return self.import_kv(item.request_id, item.inputs["kv"], prompt + [first], prompt_len=len(prompt),
                              params=item.params, generator_state=item.inputs.get("rng"))

    def _new_sequence(self, request_id: str, prompt: list[int], params: dict[str, Any]) -> Sequence:
        sampling = SamplingParams(**params.get("sampling", {}))
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed)
        return Sequence(
            order=next(self._orders),
            tokens=prompt,
            prompt_len=len(prompt),
            sampling=sampling,
            generator=generator,
            max_new_tokens=int(params.get("max_new_tokens", 1 << 30)),
            stop_ids=frozenset(int(t) for t in params.get("stop_token_ids", ())),
            request_id=request_id,
            state=self.rules.start(params),
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
        sizes = [total, total, batch + 1, batch, len(input_ids), batch * width]
        # Every part starts 16-byte aligned (an even number of int64 before it): Triton compiles
        # a kernel once per alignment of its pointers, and parts at offsets set by the step's
        # shape would make a new batch composition compile in the middle of serving.
        gaps = [n & 1 for n in sizes]
        tail: list[int] = []
        for part, gap in zip((query_start_loc, lens, input_ids, table), gaps[2:]):
            tail += part + [0] * gap
        if total == batch:  # one token per row (decodes): positions and slots per row
            positions = [start for _, start, _ in spans]
            slots = [t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions)]
            gap = [0] * gaps[0]
            packed = int64_tensor(positions + gap + slots + gap + tail)
        else:
            starts = torch.tensor([start for _, start, _ in spans], dtype=torch.int64)
            host_table = torch.tensor(table, dtype=torch.int64).view(batch, width)
            counts = torch.tensor(lens, dtype=torch.int64) - starts
            row_of = torch.repeat_interleave(torch.arange(batch), counts)
            first = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
            positions_t = starts[row_of] + torch.arange(total) - first[row_of]
            slots_t = host_table[row_of, positions_t // page_size] * page_size + positions_t % page_size
            gap_t = torch.zeros(gaps[0], dtype=torch.int64)
            packed = torch.cat([positions_t, gap_t, slots_t, gap_t, int64_tensor(tail)])
        # One split cuts out every part and every gap as views (a gap is a piece of its own, so
        # no part needs slicing after): the step's metadata views in one op.
        pieces = [n for size, gap in zip(sizes, gaps) for n in ((size, 1) if gap else (size,))]
        parts = self._to_device(packed).split_with_sizes(pieces)
        positions_d, slots_d, qsl_d, lens_d, ids_d, table_d = (
            parts[i] for i in itertools.accumulate((1 + gap for gap in gaps[:-1]), initial=0))
        meta = PagedAttentionMetadata(
            positions=positions_d,
            slot_mapping=slots_d,
            query_start_loc=qsl_d,
            seq_lens=lens_d,
            page_table=table_d.view(batch, width),
            page_size=page_size,
            backend=self.attention_backend,
            host_query_start_loc=tuple(query_start_loc),
            host_seq_lens=tuple(lens),
        )
        if isinstance(self.pool, SlidingWindowPages):
            meta = dataclasses.replace(meta, windowed=self._windowed_metadata(meta, spans))
        return meta, ids_d

    def _windowed_metadata(self, meta: PagedAttentionMetadata,
                           spans: list[tuple[str, int, int]]) -> PagedAttentionMetadata:
        """The step's metadata for the sliding-window layers: ``meta`` with the slots and
        page table of the windowed pool (worked out on the host, as ``_metadata``'s)."""
        assert isinstance(self.pool, SlidingWindowPages)
        page_size = self.pool.page_size
        tables = self.pool.windowed_tables([request_id for request_id, _, _ in spans])
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        starts = torch.tensor([start for _, start, _ in spans], dtype=torch.int64)
        counts = torch.tensor([end - start for _, start, end in spans], dtype=torch.int64)
        row_of = torch.repeat_interleave(torch.arange(len(spans)), counts)
        first = torch.cumsum(counts, 0) - counts
        positions = starts[row_of] + torch.arange(int(counts.sum())) - first[row_of]
        slots = table[row_of, positions // page_size] * page_size + positions % page_size
        return dataclasses.replace(meta, slot_mapping=self._to_device(slots), page_table=self._to_device(table))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def _advance(self, seq: Sequence, token: int, value: torch.Tensor) -> EngineOutput:
        """Append the step's ``token`` (``value``: it as a ``[1]`` tensor) to the sequence, and
        what the step writes and flags."""
        seq.computed = len(seq.tokens)
        if self.prefix_caching:  # the step wrote these K/V: their whole pages may serve others
            self.pool.register(seq.request_id, seq.tokens, seq.computed)
        seq.tokens.append(token)
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        elif seq.generated >= seq.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            reason = "length"
        out = {"token": value}
        if self.rules.extra_outputs:
            out |= self.rules.outputs(seq, token)
            if reason is not None:
                out |= self.rules.last_outputs(seq)
        seq.written = value
        if reason is None:
            return EngineOutput(out)
        return EngineOutput(out, ("stop",), reason)

    # -------------------------------------------------------------- resources
    def release(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.seen.drop(request_id)
        self.rules.release(request_id)
        self.pool.free(request_id)
        self.forward.release(request_id)
        if self._ahead is not None:
            self._ahead.rows.pop(request_id, None)
            if not self._ahead.rows:
                self._ahead = None

    # ------------------------------------------------------- KV hand-off
    def export_kv(self, request_id: str) -> torch.Tensor:
        """The K/V of the sequence's computed positions, gathered from its pages into one
        tensor ``[layers, planes, tokens, kv_heads, head_dim]`` (a copy: its pages may be freed;
        ``planes`` is 2, keys and values, or 1 for a latent cache)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} holds no sequence to export")
        if self.windowed:
            raise NotImplementedError("the K/V of a model with sliding-window layers cannot be handed off yet")
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
        if self.windowed:
            raise NotImplementedError("the K/V of a model with sliding-window layers cannot be handed off yet")
        layers = len(self.kv_caches)
        heads, head_dim = self.kv_caches[0].shape[-2:]
        planes = self.kv_caches[0].shape[0]
        computed = kv.shape[2] if kv.dim() == 5 else -1
        if kv.dim() != 5 or tuple(kv.shape[:2]) != (layers, planes) or tuple(kv.shape[3:]) != (heads, head_dim):
            raise ValueError(f"request {request_id}: KV of shape {tuple(kv.shape)} does not fit this cache "
                             f"[{layers}, {planes}, tokens, {heads}, {head_dim}]")
        if not 0 < computed < len(tokens) or not 0 < prompt_len <= len(tokens):
            raise ValueError(f"request {request_id}: KV of {computed} positions, {len(tokens)} tokens and a "
                             f"prompt of {prompt_len} do not make a sequence that can continue")
        if len(tokens) >= self.max_seq_len:
            raise ValueError(f"request {request_id}: {len(tokens)} tokens do not fit max_seq_len {self.max_seq_len}")
        seq = self._new_sequence(request_id, list(tokens[:prompt_len]), params)
        seq.tokens.extend(tokens[prompt_len:])
        seq.computed = computed
        _restore_generator(seq, generator_state)
        self.pool.reserve(request_id, computed)  # OutOfPages leaves the pool as it was
        try:
            slots = self._to_device(torch.tensor(self.pool.slots(request_id, 0, computed), dtype=torch.int64))
            for layer, cache in enumerate(self.kv_caches):
                _flat_slots(cache).index_copy_(1, slots, kv[layer].to(cache.device, cache.dtype))
        except BaseException:
            self.pool.free(request_id)
            raise
        if self.prefix_caching:
            self.pool.register(request_id, seq.tokens, computed)
        self.seqs[request_id] = seq
        return seq

    def stats(self) -> dict[str, float]:
        stats = {"kv_pages_used": self.pool.num_used_pages, "kv_pages_total": self.pool.num_pages,
                 "sequences": len(self.seqs), "preemptions": self.preemptions, "prefills_deferred": self.deferred}
        if isinstance(self.pool, SlidingWindowPages):
            stats |= {"kv_window_pages_used": self.pool.windowed.num_used_pages,
                      "kv_window_pages_total": self.pool.windowed.num_pages}
        if self.prefix_caching:
            stats |= {"kv_pages_cached": self.pool.num_cached_pages,
                      "prefix_cache_queried_tokens": self.prefix_queried, "prefix_cache_hit_tokens": self.prefix_hits}
        return stats | self.forward.stats()


class PrefillEngine(Engine):
    """The prefill half of a disaggregated LLM, around the ``engine`` that runs its steps. It
    prefills each request, samples its first token, and hands the request off: besides
    ``token`` a step writes ``kv`` (the prompt's K/V, ``export_kv``) and ``rng`` (the sampler
    state, ``generator_state``), then frees the request's pages at once. The decode engine
    adopts the request on its first decode (``import_kv``). A request that ends at its first
    token hands nothing off (``kv`` and ``rng`` stay silent: no decode follows)."""

    def __init__(self, engine: AutoregressiveEngine):
        self.engine = engine

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op != "prefill":
                raise ValueError(f"a prefill engine has no op {item.op!r}")
        outputs = self.engine.run(items)
        try:
            for item, out in zip(items, outputs):
                if "stop" not in out.flags and not out.preempted:
                    out.outputs["kv"] = self.engine.export_kv(item.request_id)
                    out.outputs["rng"] = self.engine.generator_state(item.request_id)
        finally:
            for item in items:
                self.engine.release(item.request_id)
        return outputs

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


def _restore_generator(seq: Sequence, state: torch.Tensor | None) -> None:
    """Resume a seeded sampler where another engine left it (``generator_state``)."""
    if seq.generator is not None and state is not None and state.numel():
        seq.generator.set_state(state.cpu())


def _first_id(token: torch.Tensor) -> int:
    """The id a decode's ``token`` input holds (its first element)."""
    return token.item() if token.numel() == 1 else int(token.reshape(-1)[0])


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[planes, pages, page_size, H, D]`` viewed as ``[planes, slots, H, D]``."""
    return cache.view(cache.shape[0], -1, cache.shape[-2], cache.shape[-1])
