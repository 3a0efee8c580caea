"""Batched next-token sampling with per-row parameters.

Each row is processed like Hugging Face transformers' ``generate`` would process it alone:
repetition penalty -> temperature -> top-k -> top-p -> min-p, then a categorical draw
(or argmax when ``temperature == 0``). All filtering is vectorised over the batch with
per-row parameter tensors, so a row's result depends only on its own logits, parameters,
generator and seen tokens.

The repetition penalty reads a ``[B, V]`` mask of the ids each row has seen. ``SeenTokens``
keeps those masks on the logits' device from one step to the next, so a step marks only its
rows' new ids, and a step launched before the host has read the previous one's ids marks
them (still on the device) in that step's copy alone.

Randomness uses the exponential race: with ``q_i ~ Exp(1)`` i.i.d.,
``argmax_i p_i / q_i`` is distributed as ``Categorical(p)``. A row with a generator draws
its ``V`` exponentials from that generator alone (a fixed amount per step), which makes
seeded requests reproducible whatever they are batched with; rows without one share a
single draw from the global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mstar.contract import SamplingParams
from mstar.layers.paged_kv import to_device

_MAX_TEMPERATURE = 100.0
_MAX_REPETITION_PENALTY = 100.0


def validate_sampling(params: SamplingParams) -> None:
    """Raise ``ValueError`` naming the offending field if ``params`` is unusable.

    Accepted ranges: ``0 <= temperature <= 100`` (0 is greedy), ``0 < top_p <= 1``,
    ``top_k >= -1`` (0 and -1 both disable top-k; the sampler treats any ``top_k <= 0``
    as disabled), ``0 <= min_p <= 1``, ``0 < repetition_penalty <= 100``. All floats
    must be finite.
    """
    t = params.temperature
    if not (math.isfinite(t) and 0.0 <= t <= _MAX_TEMPERATURE):
        raise ValueError(f"temperature must be finite and in [0, {_MAX_TEMPERATURE:g}], got {t}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if isinstance(params.top_k, bool) or not isinstance(params.top_k, int):
        raise ValueError(f"top_k must be an int, got {params.top_k!r}")
    if params.top_k < -1:
        raise ValueError(f"top_k must be >= 0 (or -1 to disable), got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    rp = params.repetition_penalty
    if not (math.isfinite(rp) and 0.0 < rp <= _MAX_REPETITION_PENALTY):
        raise ValueError(
            f"repetition_penalty must be finite and in (0, {_MAX_REPETITION_PENALTY:g}], got {rp}"
        )


_KEPT: dict[tuple, torch.Tensor] = {}  # ``_on``'s tensors of recent steps, by device, dtype and values
_KEPT_MAX = 256


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """Per-row values as a tensor on ``device`` (never written to: it may be shared); on a
    GPU through pinned memory without waiting for the device, so sampling never stalls a
    step launched ahead of it. Decode steps of one batch ask for the same values step after
    step, so recent tensors are kept and handed out again instead of copied anew."""
    key = (device, dtype, tuple(values))
    tensor = _KEPT.get(key)
    if tensor is None:
        tensor = to_device(torch.tensor(values, dtype=dtype), device)
        if len(_KEPT) >= _KEPT_MAX:
            _KEPT.clear()
        _KEPT[key] = tensor
    return tensor


def penalise_repeats(scores: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """The repetition penalty (transformers' rule) on ``scores`` of repeated tokens: a positive
    score divided by ``penalty``, a negative one multiplied by it."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


class Sampler:
    """Turns a batch of logits into next-token ids, one ``SamplingParams`` per row."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        seen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return ``[B]`` int64 token ids for ``[B, V]`` logits.

        ``generators[i]`` (on ``logits.device``) supplies row ``i``'s randomness; ``None``
        uses the global RNG. ``seen`` (``[B, V]`` bool, ``seen_mask`` or ``SeenTokens``)
        marks the ids each row has seen (prompt + generated) for the repetition penalty.
        """
        self._check_batch(logits, params, seen)
        if len(generators) != len(params):
            raise ValueError(f"got {len(generators)} generators for {len(params)} rows")
        penalty_active = seen is not None and any(_penalised(p) for p in params)
        if all(p.greedy for p in params) and not penalty_active:
            return logits.argmax(dim=-1)

        scores = self.processed_logits(logits, params, seen)
        tokens = scores.argmax(dim=-1)
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == len(params):
            return self._sample(scores, generators)
        if sample_rows:
            rows = _on(scores.device, sample_rows, torch.int64)
            tokens[rows] = self._sample(scores[rows], [generators[i] for i in sample_rows])
        return tokens

    def processed_logits(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 ``[B, V]`` scores each row is sampled from; filtered tokens are -inf.

        ``log_softmax`` of a sampling row is its sampling distribution. Greedy rows get
        only the repetition penalty (their token is the argmax). ``logits`` is not modified.
        """
        self._check_batch(logits, params, seen)
        scores = logits.to(torch.float32, copy=True)
        if seen is not None and any(_penalised(p) for p in params):
            scores = self._apply_repetition_penalty(scores, params, seen)

        if all(p.greedy for p in params):
            return scores
        temps = [1.0 if p.greedy else p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            temps_t = _on(scores.device, temps, torch.float32)
            scores = scores / temps_t[:, None]
        return self._apply_filters(scores, params)

    # ------------------------------------------------------------------ steps
    @staticmethod
    def _check_batch(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seen: torch.Tensor | None,
    ) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if len(params) != logits.shape[0]:
            raise ValueError(f"got {len(params)} params for {logits.shape[0]} rows")
        if seen is not None and seen.shape != logits.shape:
            raise ValueError(f"seen is {tuple(seen.shape)}, the logits {tuple(logits.shape)}")

    @staticmethod
    def _apply_repetition_penalty(
        scores: torch.Tensor,
        params: Sequence[SamplingParams],
        seen: torch.Tensor,
    ) -> torch.Tensor:
        """Divide positive / multiply negative scores of seen tokens by the row's penalty."""
        penalty = _on(scores.device, [p.repetition_penalty for p in params], torch.float32)[:, None]
        return torch.where(seen, penalise_repeats(scores, penalty), scores)

    @staticmethod
    def _apply_filters(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Top-k, then top-p, then min-p, each only on rows that enable it (never greedy ones)."""
        batch, vocab = scores.shape
        device = scores.device
        sampling = [not p.greedy for p in params]
        use_k = [s and 0 < p.top_k < vocab for s, p in zip(sampling, params)]
        use_p = [s and p.top_p < 1.0 for s, p in zip(sampling, params)]
        use_min_p = [s and p.min_p > 0.0 for s, p in zip(sampling, params)]
        neg_inf = float("-inf")

        if any(use_k) or any(use_p):
            # One ascending sort serves both filters: top-k only masks a prefix of it.
            sorted_scores, order = scores.sort(dim=-1)
            remove = torch.zeros_like(sorted_scores, dtype=torch.bool)
            if any(use_k):
                # Index of the k-th largest score; disabled rows use index 0 (the minimum).
                kth_index = [vocab - p.top_k if on else 0 for on, p in zip(use_k, params)]
                kth = sorted_scores.gather(1, _on(device, kth_index, torch.int64)[:, None])
                remove |= sorted_scores < kth
            if any(use_p):
                probs = _softmax(sorted_scores.masked_fill(remove, neg_inf))
                # Drop the low tail whose total mass is <= 1 - top_p; -1 never matches.
                tail = [1.0 - p.top_p if on else -1.0 for on, p in zip(use_p, params)]
                tail_t = _on(device, tail, torch.float32)[:, None]
                drop = probs.cumsum(dim=-1) <= tail_t
                drop[:, -1] = False  # always keep the most likely token
                remove |= drop
            unsorted_remove = torch.empty_like(remove).scatter_(1, order, remove)
            scores = scores.masked_fill(unsorted_remove, neg_inf)

        if any(use_min_p):
            probs = scores.softmax(dim=-1)
            min_p = _on(device, [p.min_p if on else 0.0 for on, p in zip(use_min_p, params)], torch.float32)[:, None]
            # The most likely token always passes since min_p <= 1.
            scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), neg_inf)
        return scores

    @staticmethod
    def _sample(
        scores: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """Draw one token per row from ``softmax(scores)`` by the exponential race: the
        argmax of ``p_i / e_i`` (``e_i`` standard exponential draws), taken in the log domain
        as the argmax of ``scores_i - log e_i`` (the same token; no softmax pass over the
        vocabulary, which for a few rows of a large vocabulary is one slow block per row)."""
        noise = torch.empty_like(scores)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            noise.exponential_()
        elif shared:
            draw = torch.empty(len(shared), scores.shape[1], device=scores.device)
            noise[_on(scores.device, shared, torch.int64)] = draw.exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # Guard against a zero draw (log 0 is -inf: the row would pick a filtered token).
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (scores - noise.log_()).argmax(dim=-1)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.softmax(-1)`` through ``logsumexp``: torch's softmax kernel gives each row one
    thread block, slow for a few rows of a 150k vocabulary (65 us a row on an H200); the
    reductions here spread a row over the device. On the CPU torch's own softmax is the
    faster (one vectorised pass per row)."""
    if not scores.is_cuda:
        return scores.softmax(dim=-1)
    return (scores - scores.logsumexp(dim=-1, keepdim=True)).exp()


def seen_mask(seen_tokens: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, vocab]`` bool: row ``i`` marks the ids of ``seen_tokens[i]`` (those outside
    ``[0, vocab)`` are ignored)."""
    mask = torch.zeros(len(seen_tokens), vocab, dtype=torch.bool)
    for row, ids in enumerate(seen_tokens):
        ids = torch.tensor([t for t in set(ids) if 0 <= t < vocab], dtype=torch.int64)
        mask[row, ids] = True
    return mask.to(device)


class SeenTokens:
    """The ids each sequence has seen, as rows of one device table ``[slots, V]``, kept
    from step to step: a step marks only the ids its sequences gained since their last
    (``mask``), so the host never re-sends a history. Slot 0 stays empty; it stands for
    the rows that are not tracked (no repetition penalty). ``drop`` frees a sequence's
    slot; the table doubles when it runs out of slots. ``mask`` runs where the engine
    samples (under ``torch.inference_mode``)."""

    def __init__(self):
        self.table: torch.Tensor | None = None
        self.slots: dict[str, int] = {}
        self.marked: dict[str, int] = {}  # how many of the sequence's tokens its row holds
        self._free: list[int] = []

    def mask(self, keys: Sequence[str | None], tokens: Sequence[Sequence[int]], vocab: int,
             device: torch.device, pending: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, vocab]`` bool for the rows ``keys`` (None: not tracked, no id marked) whose
        histories are ``tokens``; ``pending`` (``[B]`` ids on ``device``), a token each row
        has taken that is not in ``tokens`` yet, is marked in the returned copy only."""
        rows, cols = [], []
        for key, ids in zip(keys, tokens):
            if key is None:
                continue
            slot = self._slot(key, vocab, device)
            new = [t for t in ids[self.marked[key]:] if 0 <= t < vocab]
            rows.extend([slot] * len(new))
            cols.extend(new)
            self.marked[key] = len(ids)
        if cols:
            where = to_device(torch.tensor([rows, cols], dtype=torch.int64), device)  # new each step: not kept
            # A tensor value: ``= True`` would copy a host scalar over and wait on the device.
            self.table.index_put_((where[0], where[1]), self._true)
        index = _on(device, [0 if key is None else self.slots[key] for key in keys], torch.int64)
        mask = self._table(vocab, device).index_select(0, index)
        if pending is not None:
            tracked = _on(device, [key is not None for key in keys], torch.bool)
            mask[torch.arange(len(keys), device=device), pending.clamp(0, vocab - 1)] |= tracked
        return mask

    def drop(self, key: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.marked.pop(key)
            self._free.append(slot)  # cleared when taken again (the table is an inference tensor)

    def _slot(self, key: str, vocab: int, device: torch.device) -> int:
        slot = self.slots.get(key)
        if slot is None:
            table = self._table(vocab, device)
            if not self._free:
                grown = table.shape[0]
                self.table = torch.cat([table, torch.zeros_like(table)])
                self._free = list(range(2 * grown - 1, grown - 1, -1))
            slot = self.slots[key] = self._free.pop()
            self.table[slot] = False
            self.marked[key] = 0
        return slot

    def _table(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.table is None:
            self.table = torch.zeros(8, vocab, dtype=torch.bool, device=device)
            self._true = torch.ones((), dtype=torch.bool, device=device)
            self._free = list(range(7, 0, -1))
        return self.table
