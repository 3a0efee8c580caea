"""The eager reference loop: prompts to frames with the dual AR, batched on a paged cache.

What a serving engine does step by step, written plainly so engines can be checked against
it: one prefill of every prompt, then per step the slow token (drawn among the semantic
tokens and ``<|im_end|>`` alone: ``slow_candidates``), the fast AR's frame for the rows still talking, and the next
input (the token and its frame). A request stops at ``<|im_end|>`` (no frame) or after
``max_frames``. Sampling draws from each request's own generator, so a request's frames do
not depend on what it is batched with.

Sampling is fish-speech's (S2, ``decode_one_token_ar``): top-k and top-p over the untempered
probabilities (the token that carries the total past top-p dropped, unless it is the most
likely), then the temperature. Repetition-aware sampling: each decode step (not the
prefill's) also draws the slow token at temperature 1.0 and top-p 0.9, and takes that draw
when the ordinary one is a semantic token among the request's last 10 decode-step tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.paging import step_metadata
from mstar.model.fish_s2_pro.prompt import slow_candidates

RAS_WINDOW = 10
RAS_TEMPERATURE = 1.0
RAS_TOP_P = 0.9


@dataclass
class Sampling:
    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    greedy: bool = False
    repetition_aware: bool = True


def pick(logits: torch.Tensor, generator: torch.Generator | None, sampling: Sampling,
         temperature: float | None = None, top_p: float | None = None) -> int:
    """One id from ``logits [V]``: argmax when greedy (or without a generator), else a draw
    as fish-speech's ``logits_to_probs`` shapes it."""
    if sampling.greedy or generator is None:
        return int(logits.argmax())
    ordered, ids = logits.float().sort(descending=True)
    total = torch.softmax(ordered, dim=-1).cumsum(0)
    drop = (total > (sampling.top_p if top_p is None else top_p)) | (torch.arange(len(ordered)) >= sampling.top_k)
    drop[0] = False
    tempered = ordered.masked_fill(drop, float("-inf")) / max(sampling.temperature if temperature is None
                                                              else temperature, 1e-5)
    return int(ids[torch.multinomial(torch.softmax(tempered, dim=-1), 1, generator=generator)])


def pick_slow(logits: torch.Tensor, generator: torch.Generator | None, sampling: Sampling,
              recent: deque[int] | None, semantic: range, ids: Sequence[int] | None = None) -> int:
    """The slow token, with repetition-aware sampling on decode steps (``recent``: the
    request's last decode-step tokens; None at the prefill). ``ids``: the token of each
    entry of ``logits`` (``slow_candidates``); None: the entry's index is the token."""

    def draw(temperature: float | None = None, top_p: float | None = None) -> int:
        index = pick(logits, generator, sampling, temperature, top_p)
        return index if ids is None else ids[index]

    token = draw()
    if recent is None or sampling.greedy or generator is None or not sampling.repetition_aware:
        return token
    fallback = draw(RAS_TEMPERATURE, RAS_TOP_P)
    return fallback if token in semantic and token in recent else token


def generate(model: DualAR, prompts: Sequence[tuple[torch.Tensor, torch.Tensor]], max_frames: int,
             sampling: Sampling | None = None, seeds: Sequence[int] | None = None,
             page_size: int = 16) -> list[torch.Tensor]:
    """Each prompt's frames ``[F, N]``; ``prompts``: ``(tokens [T], codes [T, N])``."""
    c, sampling = model.config, sampling or Sampling(greedy=True)
    device = next(model.parameters()).device
    gens = [torch.Generator().manual_seed(s) for s in seeds] if seeds is not None else [None] * len(prompts)
    needs = [math.ceil((len(tokens) + max_frames) / page_size) for tokens, _ in prompts]
    pages = [list(range(sum(needs[:i]), sum(needs[:i + 1]))) for i in range(len(prompts))]
    layers, heads, head_dim = model.cache_shape()
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_cache(layers, sum(needs), page_size, heads, head_dim, dtype, device)
    frames: list[list[torch.Tensor]] = [[] for _ in prompts]
    recent: list[deque[int] | None] = [None] * len(prompts)  # None until the first decode step
    semantic = range(c.semantic_begin_id, c.semantic_begin_id + c.codebook_size)
    active = list(range(len(prompts)))
    tokens = torch.cat([t for t, _ in prompts]).to(device)
    codes = torch.cat([k for _, k in prompts]).to(device)
    starts, counts = [0] * len(prompts), [len(t) for t, _ in prompts]
    with torch.no_grad():
        while active:
            meta = step_metadata([pages[i] for i in active], [starts[i] for i in active],
                                 [counts[i] for i in active], page_size, device)
            normed, fast_input = model.slow(tokens, codes, meta, caches)
            last = torch.tensor(meta.host_query_start_loc[1:], device=device) - 1
            logits, ids = slow_candidates(model.slow.logits(normed[last]), c.semantic_begin_id, c.codebook_size,
                                          c.eos_token_id)
            logits = logits.float().cpu()
            chosen = [pick_slow(logits[row], gens[i], sampling, recent[i], semantic, ids)
                      for row, i in enumerate(active)]
            for token, i in zip(chosen, active, strict=True):
                if recent[i] is None:
                    recent[i] = deque(maxlen=RAS_WINDOW)
                else:
                    recent[i].append(token)
            talking = [row for row, token in enumerate(chosen) if token != c.eos_token_id]
            if talking:
                rows = torch.tensor(talking, device=device)
                code0 = model.code0(torch.tensor([chosen[r] for r in talking], device=device))
                fast_gens = [gens[active[r]] for r in talking]

                def fast_pick(book_logits: torch.Tensor, book: int, fast_gens=fast_gens) -> torch.Tensor:
                    return torch.tensor([pick(book_logits[j], g, sampling) for j, g in enumerate(fast_gens)],
                                        device=device)

                frame = model.fast(fast_input[last[rows]], code0, sampler=fast_pick).codes
            for i in active:
                starts[i] += counts[i]
                counts[i] = 1
            next_active, next_tokens, next_codes = [], [], []
            for j, row in enumerate(talking):
                i = active[row]
                frames[i].append(frame[j])
                if len(frames[i]) < max_frames:
                    next_active.append(i)
                    next_tokens.append(chosen[row])
                    next_codes.append(frame[j])
            active = next_active
            if active:
                tokens = torch.tensor(next_tokens, device=device)
                codes = torch.stack(next_codes)
    return [torch.stack(f) if f else torch.zeros(0, c.num_codebooks, dtype=torch.int64) for f in frames]
