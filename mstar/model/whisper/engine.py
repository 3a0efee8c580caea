"""Whisper's engines: the batched audio encoder, and the decoder as an autoregressive engine
with fixed-shape cross-attention K/V slots (written once per request) and Whisper's token rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, Sequence
from mstar.engine.base import EngineItem
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots
from mstar.model.whisper.graphs import WhisperDecodeGraphs, WhisperEncoderGraphs

# The sequence holding the scratch page of the CUDA graphs' padded rows in the page pool.
GRAPH_SCRATCH = "\0whisper-graph-scratch"


def encoder_fn(model, graphs: WhisperEncoderGraphs | None = None):
    """The encoder node: every window of the plan in one batched forward, in the model's
    device and dtype (a replay of ``graphs`` when given)."""
    encode = model.encode if graphs is None else graphs.run

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.model.encoder.conv1.weight
        mel = torch.stack([item.inputs["mel"] for item in items])
        if mel.device != weight.device:
            mel = (mel.pin_memory() if weight.is_cuda else mel).to(weight.device, non_blocking=True)
        features = encode(mel.to(weight.dtype))
        return [{"audio_features": f} for f in features]

    return run


@dataclass(frozen=True)
class WhisperRules:
    """Token ids the decoder needs beyond the model: what to suppress and what to detect."""

    vocab_size: int
    eot: int
    sot: int
    no_timestamps: int
    transcribe: int
    translate: int
    language_ids: tuple[int, ...]
    suppress: tuple[int, ...]  # never produced as text
    begin_suppress: tuple[int, ...]  # not as the first text token


class WhisperDecoderEngine(AutoregressiveEngine):
    """Request params it reads besides the generic ones: ``detect_language`` (the prompt ends
    at SOT: pick the language token, then force the task and no-timestamps tokens) and
    ``task`` ("transcribe" or "translate").

    Cross-attention K/V live in ``cross_slots`` (``max_requests`` slots, allocated at
    startup): a request takes one at its prefill, which writes its K/V there (all the step's
    prefills in one projection), and gives it back in ``release``, however it ends. A failed
    first step gives it back too (the base engine releases fresh requests).

    ``cuda_graphs``: decode-only steps replay per-bucket graphs (``WhisperDecodeGraphs``); the
    page pool gets one page more, held as the padded rows' scratch page. On the CPU the same
    bucketed path runs eagerly (tests).

    ``overlap_scheduling`` (the base engine's): the steps launched ahead run ``decode_logits``
    (cross slots, graphs) and ``choose_on_device`` (suppress masks, then the sampler); a
    sequence with a forced token pending is never launched ahead (``_continues``).
    """

    def __init__(self, model, rules: WhisperRules, *, max_requests: int, cuda_graphs: bool = False,
                 graph_batch_sizes=DEFAULT_BATCH_SIZES, **kwargs):
        if cuda_graphs:
            kwargs["num_pages"] += 1
        super().__init__(model, **kwargs)
        self.rules = rules
        layers, frames, heads, head_dim = model.cross_layout()
        self.cross_slots = CrossKVSlots(layers, max_requests, frames, heads, head_dim, kwargs["dtype"], self.device)
        self.graphs: WhisperDecodeGraphs | None = None
        if cuda_graphs:
            page_size = self.pool.page_size
            scratch = self.pool.reserve(GRAPH_SCRATCH, 1)[0]
            sizes = [size for size in graph_batch_sizes if size < max_requests] + [max_requests]
            self.graphs = WhisperDecodeGraphs(
                model, self.kv_caches, self.cross_slots, page_size=page_size,
                max_pages_per_seq=-(-self.max_seq_len // page_size), scratch_page=scratch,
                batch_sizes=sizes, backend=self.attention_backend)
        mask = torch.zeros(rules.vocab_size, dtype=torch.bool)
        mask[list(rules.suppress)] = True
        mask[rules.sot:] = True  # special and timestamp tokens never appear in text
        self.suppress_mask = mask.to(self.device)
        self.begin_mask = mask.clone()
        self.begin_mask[list(rules.begin_suppress)] = True
        self.begin_mask = self.begin_mask.to(self.device)
        self.language_ids = torch.tensor(rules.language_ids, dtype=torch.int64, device=self.device)

    @property
    def cross(self) -> dict[str, int]:
        """Request id -> cross-attention K/V slot of every request holding one."""
        return self.cross_slots.held()

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, items: list[EngineItem]) -> torch.Tensor:
        counts = [len(seq.tokens) - seq.computed for seq in (self.seqs[item.request_id] for item in items)]
        slots = self._to_device(torch.tensor(self._slots(items), dtype=torch.int64))
        return self._decode(input_ids, meta, slots, None if all(n == 1 for n in counts) else counts)

    def decode_logits(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                      items: list[EngineItem]) -> torch.Tensor:
        """A step launched ahead: every item already holds its cross K/V slot."""
        slots = self._to_device(torch.tensor([self.cross_slots.slot(item.request_id) for item in items],
                                             dtype=torch.int64))
        return self.model.compute_logits(self._decode(input_ids, meta, slots, None))

    def _decode(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, slots: torch.Tensor,
                counts: list[int] | None) -> torch.Tensor:
        """Hidden states of a step whose sequence ``b`` reads cross slot ``slots[b]`` and has
        ``counts[b]`` new tokens (None: one each, a decode-only step the graphs may replay)."""
        if self.graphs is not None and counts is None and self.graphs.fits(len(slots), meta):
            return self.graphs.run(input_ids, meta, slots)
        cross = CrossAttentionBatch.build(slots, counts, frames=self.cross_slots.frames,
                                          sink=self.cross_slots.sink, backend=self.attention_backend)
        return self.model.decode(input_ids, meta, self.kv_caches, self.cross_slots.layers, cross)

    def _slots(self, items: list[EngineItem]) -> list[int]:
        """Each item's cross K/V slot; a prefill first takes one and writes its K/V there."""
        fresh = [item for item in items if item.op == "prefill"]
        if fresh:
            taken = [self.cross_slots.acquire(item.request_id) for item in fresh]
            buffer = self.cross_slots.buffer
            width = buffer.shape[-2] * buffer.shape[-1]
            features = torch.stack([item.inputs["audio_features"].reshape(-1, width).to(self.device)
                                    for item in fresh])
            slots = self._to_device(torch.tensor(taken, dtype=torch.int64))
            self.model.write_cross_kv(features.to(buffer.dtype), slots, self.cross_slots.layers)
        return [self.cross_slots.slot(item.request_id) for item in items]

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.choose_on_device(logits, seqs).tolist()

    def choose_on_device(self, logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
        """Each row's next id, left on the device: a pending forced token (task, no-timestamps
        after a detected language); at a detecting sequence's first step the likeliest language
        (then the task and no-timestamps tokens are forced); else the sampler's pick from the
        logits with the suppressed tokens at -inf. Host work is one pass over the rows' state;
        the rows are gathered and scattered by a few batched ops. A step launched ahead
        (``lead`` 1) only ever holds sampled rows (``_continues``)."""
        forced: list[tuple[int, int]] = []  # (row, id)
        detect: list[int] = []
        if not lead:
            for row, seq in enumerate(seqs):
                state = seq.extra
                if state.get("forced"):
                    forced.append((row, state["forced"].pop(0)))
                elif state["detect"] and seq.generated == 0:
                    task = self.rules.translate if state.get("task") == "translate" else self.rules.transcribe
                    state["forced"] = [task, self.rules.no_timestamps]
                    detect.append(row)
        logits = logits.float()
        if not forced and not detect:
            return self._sample(self._suppressed(logits, seqs, lead), seqs)
        taken = {row for row, _ in forced} | set(detect)
        sampled = [row for row in range(len(seqs)) if row not in taken]
        order = [row for row, _ in forced] + detect + sampled
        index = self._to_device(torch.tensor([token for _, token in forced] + order, dtype=torch.int64))
        forced_ids, rows = index[:len(forced)], index[len(forced):]
        parts = [forced_ids]
        if detect:
            scores = logits[rows[len(forced):len(forced) + len(detect)]][:, self.language_ids]
            parts.append(self.language_ids[scores.argmax(-1)])
        if sampled:
            chosen = [seqs[row] for row in sampled]
            parts.append(self._sample(self._suppressed(logits[rows[len(forced) + len(detect):]], chosen), chosen))
        ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        return ids.index_copy_(0, rows, torch.cat(parts))

    def _continues(self, seq: Sequence) -> bool:
        """Besides the base's limits, the next choice must need nothing the host decides: no
        forced token pending. (A language is detected at a request's first step, its prefill,
        which is never launched ahead; that choice leaves the task and no-timestamps pending.)"""
        return super()._continues(seq) and not seq.extra.get("forced")

    def _suppressed(self, logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
        """``logits`` with the tokens no row may produce at -inf (the first text token of a
        sequence also avoids ``begin_suppress``): one masked fill for the batch. ``lead``: the
        rows choose the token ``lead`` places after their host state's next one."""
        first = [seq.generated + lead == seq.extra.get("text_start", 0) for seq in seqs]
        if any(first):
            flags = self._to_device(torch.tensor(first)).view(-1, 1)
            mask = torch.where(flags, self.begin_mask, self.suppress_mask)
        else:
            mask = self.suppress_mask
        return logits.masked_fill(mask, float("-inf"))

    def _new_sequence(self, prompt, params):
        seq = super()._new_sequence(prompt, params)
        detect = bool(params.get("detect_language"))
        seq.extra["detect"] = detect
        seq.extra["task"] = params.get("task", "transcribe")
        seq.extra["text_start"] = 3 if detect else 0  # language, task and no-timestamps come first
        return seq

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.cross_slots.free(request_id)

    def stats(self) -> dict[str, float]:
        stats = super().stats() | {"cross_kv_slots_used": self.cross_slots.pool.num_used,
                                   "cross_kv_slots_total": self.cross_slots.capacity}
        if self.graphs is not None:  # the scratch page is no request's
            stats["kv_pages_used"] -= 1
            stats["kv_pages_total"] -= 1
        return stats
