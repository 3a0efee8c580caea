"""Whisper's engines: the batched audio encoder, and the decoder as an autoregressive engine
with fixed-shape cross-attention K/V slots (written once per request) and Whisper's token rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, Sequence
from mstar.engine.base import EngineItem
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from mstar.layers.attention import PagedAttentionMetadata
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots
from mstar.model.whisper.graphs import WhisperDecodeGraphs

# The sequence holding the scratch page of the CUDA graphs' padded rows in the page pool.
GRAPH_SCRATCH = "\0whisper-graph-scratch"


def encoder_fn(model):
    """The encoder node: every window of the plan in one batched forward, in the model's
    device and dtype."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.model.encoder.conv1.weight
        mel = torch.stack([item.inputs["mel"] for item in items])
        if mel.device != weight.device:
            mel = (mel.pin_memory() if weight.is_cuda else mel).to(weight.device, non_blocking=True)
        features = model.encode(mel.to(weight.dtype))
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
        one_each = all(n == 1 for n in counts)
        if self.graphs is not None and one_each and self.graphs.fits(len(items), meta):
            return self.graphs.run(input_ids, meta, slots)
        cross = CrossAttentionBatch.build(slots, None if one_each else counts, frames=self.cross_slots.frames,
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
        logits = logits.float()
        chosen: dict[int, int] = {}
        for row, seq in enumerate(seqs):
            state = seq.extra
            if state.get("forced"):
                chosen[row] = state["forced"].pop(0)
            elif state["detect"] and seq.generated == 0:
                lang = int(self.language_ids[logits[row, self.language_ids].argmax()])
                task = self.rules.translate if state.get("task") == "translate" else self.rules.transcribe
                state["forced"] = [task, self.rules.no_timestamps]
                chosen[row] = lang
        sampled = [row for row in range(len(seqs)) if row not in chosen]
        if sampled:
            rows = [seqs[r] for r in sampled]
            picks = super().choose(self._suppressed(logits if len(sampled) == len(seqs) else logits[sampled], rows),
                                   rows)
            chosen.update(zip(sampled, picks))
        return [chosen[row] for row in range(len(seqs))]

    def _suppressed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` with the tokens no row may produce at -inf (the first text token of a
        sequence also avoids ``begin_suppress``): one masked fill for the batch."""
        first = [seq.generated == seq.extra.get("text_start", 0) for seq in seqs]
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
