"""The eager reference loop: prompts to frames with the dual AR, batched on a paged cache.

What a serving engine does step by step, written plainly so engines can be checked against
it: one prefill of every prompt, then per step the slow token (drawn among the semantic
tokens and ``<|im_end|>`` alone: ``slow_candidates``), the fast AR's frame for the rows still
talking, and the next input (the token and its frame). A request stops at ``<|im_end|>`` (no
frame) or after ``max_frames``. Sampling (``sampling.py``: fish-speech's, with
repetition-aware redraws) draws from each request's own generator, so a request's frames do
not depend on what it is batched with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.paging import step_metadata
from mstar.model.fish_s2_pro.prompt import slow_candidates
from mstar.model.fish_s2_pro.sampling import RowSampling, Sampling, choose_slow, draw_rows, fast_sampler

__all__ = ["Sampling", "generate", "pick", "pick_slow"]


def pick(logits: torch.Tensor, generator: torch.Generator | None, sampling: Sampling,
         temperature: float | None = None, top_p: float | None = None) -> int:
    """One index into ``logits [V]``: the argmax when greedy (or without a generator), else a
    draw (``sampling.draw_rows`` on one row)."""
    row = RowSampling(sampling, generator)
    return int(draw_rows(logits[None], [row], row.uniforms(1), temperature, top_p)[0])


def pick_slow(logits: torch.Tensor, generator: torch.Generator | None, sampling: Sampling,
              recent: deque[int] | None, semantic: range, ids: Sequence[int] | None = None) -> int:
    """One slow token from ``logits [V]`` (``ids``: each entry's token; None: its index), with
    repetition-aware sampling against ``recent`` (None: the prefill's draw)."""
    row = RowSampling(sampling, generator, None if recent is None else deque(recent, maxlen=recent.maxlen))
    return choose_slow(logits[None], ids if ids is not None else range(logits.shape[-1]), [row], semantic)[0]


def generate(model: DualAR, prompts: Sequence[tuple[torch.Tensor, torch.Tensor]], max_frames: int,
             sampling: Sampling | None = None, seeds: Sequence[int] | None = None,
             page_size: int = 16) -> list[torch.Tensor]:
    """Each prompt's frames ``[F, N]``; ``prompts``: ``(tokens [T], codes [T, N])``."""
    c, sampling = model.config, sampling or Sampling(greedy=True)
    device = next(model.parameters()).device
    gens = [torch.Generator().manual_seed(s) for s in seeds] if seeds is not None else [None] * len(prompts)
    samplers = [RowSampling(sampling, g) for g in gens]
    needs = [math.ceil((len(tokens) + max_frames) / page_size) for tokens, _ in prompts]
    pages = [list(range(sum(needs[:i]), sum(needs[:i + 1]))) for i in range(len(prompts))]
    layers, heads, head_dim = model.cache_shape()
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_cache(layers, sum(needs), page_size, heads, head_dim, dtype, device)
    frames: list[list[torch.Tensor]] = [[] for _ in prompts]
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
            chosen = choose_slow(logits, ids, [samplers[i] for i in active], semantic)
            talking = [row for row, token in enumerate(chosen) if token != c.eos_token_id]
            if talking:
                rows = torch.tensor(talking, device=device)
                code0 = model.code0(torch.tensor([chosen[r] for r in talking], device=device))
                sampler = fast_sampler([samplers[active[r]] for r in talking], c.num_codebooks, device)
                frame = model.fast(fast_input[last[rows]], code0, sampler=sampler).codes
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
