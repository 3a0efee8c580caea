"""S2's sampling, batched on the logits' device and reproducible per request.

A draw is fish-speech's (S2, ``decode_one_token_ar``): top-k and top-p over the untempered
probabilities (the token that carries the total past top-p dropped, unless it is the most
likely), then the temperature. The id is then found by inverse CDF from one uniform number
drawn from the request's own CPU generator. A row reads only its own logits and its own
number, so a request's draws do not depend on its batch, while the whole batch samples in one
device call: per step the host sends a few numbers a row and reads the slow tokens back once;
the fast AR's codes never leave the device.

Repetition-aware sampling (RAS): each decode step (not the prefill's) of a request that
samples also draws the slow token at temperature 1.0 and top-p 0.9, and takes that draw when
the ordinary one is a semantic token among its last 10 decode-step tokens.

Per step a request draws its numbers in this order: the slow token's, the RAS redraw's (when
RAS applies), then one per fast codebook (``N - 1``) once its slow token is not ``<|im_end|>``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RAS_TEMPERATURE", "RAS_TOP_P", "RAS_WINDOW", "RowSampling", "Sampling", "choose_slow", "draw_rows",
           "fast_sampler"]

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


@dataclass
class RowSampling:
    """One request's sampling: its options, its generator (None: greedy) and its recent
    decode-step slow tokens (None until its first decode step)."""

    sampling: Sampling
    generator: torch.Generator | None
    recent: deque[int] | None = None

    @property
    def draws(self) -> bool:
        return not self.sampling.greedy and self.generator is not None

    def uniforms(self, count: int) -> torch.Tensor:
        """The request's next ``count`` numbers in [0, 1) (zeros for a greedy request, which
        draws none)."""
        return torch.rand(count, generator=self.generator) if self.draws else torch.zeros(count)


def draw_rows(logits: torch.Tensor, rows: Sequence[RowSampling], uniforms: torch.Tensor,
              temperature: float | None = None, top_p: float | None = None) -> torch.Tensor:
    """Each row's index ``[B]`` into ``logits [B, V]`` (on their device): the argmax for a greedy
    row, else the draw of ``uniforms[b]`` (``temperature``, ``top_p``: instead of the rows' own)."""
    device = logits.device
    best = logits.argmax(dim=-1)
    if not any(row.draws for row in rows):
        return best

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    temp = per_row([row.sampling.temperature if temperature is None else temperature for row in rows], torch.float32)
    p = per_row([row.sampling.top_p if top_p is None else top_p for row in rows], torch.float32)
    k = per_row([row.sampling.top_k for row in rows], torch.int64)
    ordered, ids = logits.float().sort(dim=-1, descending=True, stable=True)
    total = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = (total > p[:, None]) | (torch.arange(ordered.shape[-1], device=device)[None] >= k[:, None])
    drop[:, 0] = False  # the kept ids are a prefix of the ordered ones, never empty
    cdf = (ordered.masked_fill(drop, float("-inf")) / temp.clamp(min=1e-5)[:, None]).softmax(dim=-1).cumsum(dim=-1)
    target = uniforms.to(device, torch.float32)[:, None] * cdf[:, -1:]
    at = torch.searchsorted(cdf, target, right=True)[:, 0]
    at = torch.minimum(at, (~drop).sum(dim=-1) - 1)  # a number rounding up to the total stays inside
    sampled = ids.gather(1, at[:, None])[:, 0]
    return torch.where(per_row([not row.draws for row in rows], torch.bool), best, sampled)


def choose_slow(candidates: torch.Tensor, ids: Sequence[int], rows: Sequence[RowSampling], semantic: range,
                ) -> list[int]:
    """Each row's slow token from the logits of its candidates ``[B, K]`` (``ids``: the token of
    each column), with RAS; the rows' recent tokens are updated."""
    main = draw_rows(candidates, rows, torch.stack([row.uniforms(1)[0] for row in rows]))
    redraw = [b for b, row in enumerate(rows) if row.recent is not None and row.draws
              and row.sampling.repetition_aware]
    fallback: list[int] = []
    if redraw:
        subset = [rows[b] for b in redraw]
        index = torch.tensor(redraw, device=candidates.device)
        fallback = draw_rows(candidates.index_select(0, index), subset,
                             torch.stack([row.uniforms(1)[0] for row in subset]),
                             RAS_TEMPERATURE, RAS_TOP_P).tolist()
    tokens = [ids[i] for i in main.tolist()]
    for b, alternative in zip(redraw, fallback, strict=True):
        recent = rows[b].recent
        if tokens[b] in semantic and recent is not None and tokens[b] in recent:
            tokens[b] = ids[alternative]
    for token, row in zip(tokens, rows, strict=True):
        if row.recent is None:
            row.recent = deque(maxlen=RAS_WINDOW)  # the prefill's token does not count
        else:
            row.recent.append(token)
    return tokens


def fast_sampler(rows: Sequence[RowSampling], num_codebooks: int,
                 device: torch.device) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The fast AR's sampler for one frame of ``rows``: codebook ``i``'s codes ``[B]`` from its
    logits ``[B, codebook_size]``, on the device; each row's numbers drawn now, in order."""
    uniforms = torch.stack([row.uniforms(num_codebooks - 1) for row in rows]).to(device)

    def sample(logits: torch.Tensor, book: int) -> torch.Tensor:
        return draw_rows(logits, rows, uniforms[:, book - 1])

    return sample
