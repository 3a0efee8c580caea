"""T3's next-token filters, in the reference's orders.

The project sampler (``mstar.engine.sampler``) filters in Hugging Face ``generate``'s order
(penalty -> temperature -> top-k -> top-p -> min-p). Chatterbox's loops differ, and the order
changes which tokens survive, so T3 keeps its own:

* English and multilingual (the guided loop of ``T3.inference``): repetition penalty ->
  temperature -> min-p -> top-p, on the guided logits; the history the penalty reads starts
  with the start-of-speech token.
* Turbo (``T3.inference_turbo``): temperature -> top-k -> top-p -> repetition penalty; the
  first step's history is the start-of-speech token alone, later ones the generated tokens
  without it.

The draw is ``torch.multinomial`` over the softmax with the request's generator, as the
reference draws, so a CPU run seeded like the reference's global generator picks the same
tokens. Temperature 0 is greedy (the argmax of the penalised logits). Each function takes
``[B, V]`` scores and one ``SamplingParams`` per row and returns new float32 scores, filtered
tokens at -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.contract import SamplingParams

NEG_INF = float("-inf")


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]


def repetition_penalty(scores: torch.Tensor, params: Sequence[SamplingParams], seen: torch.Tensor) -> torch.Tensor:
    """Seen tokens' scores divided (positive) or multiplied (negative) by the row's penalty."""
    penalty = _column([p.repetition_penalty for p in params], scores)
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def temperature(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Divided by the row's temperature (greedy rows and temperature 1 unchanged)."""
    temps = [1.0 if p.greedy else p.temperature for p in params]
    return scores if all(t == 1.0 for t in temps) else scores / _column(temps, scores)


def min_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Tokens less likely than ``min_p`` times the row's most likely one removed."""
    if all(p.min_p <= 0.0 for p in params):
        return scores
    probs = scores.softmax(dim=-1)
    threshold = _column([p.min_p for p in params], scores) * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < threshold, NEG_INF)


def top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The least likely tail whose mass is at most ``1 - top_p`` removed (the most likely token
    always kept)."""
    if all(p.top_p >= 1.0 for p in params):
        return scores
    sorted_scores, order = scores.sort(dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    tail = _column([1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params], scores)
    drop = cumulative <= tail
    drop[:, -1] = False
    return scores.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), NEG_INF)


def top_k(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """All but the row's ``top_k`` highest scores removed (``top_k <= 0``: no filter)."""
    vocab = scores.shape[-1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    if all(k == vocab for k in ks):
        return scores
    sorted_desc = scores.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, torch.tensor(ks, device=scores.device)[:, None] - 1)
    return scores.masked_fill(scores < kth, NEG_INF)


def guided_scores(logits: torch.Tensor, params: Sequence[SamplingParams], seen: torch.Tensor) -> torch.Tensor:
    """English / multilingual order: penalty -> temperature -> min-p -> top-p."""
    scores = repetition_penalty(logits.float(), params, seen)
    if all(p.greedy for p in params):
        return scores
    return top_p(min_p(temperature(scores, params), params), params)


def turbo_scores(logits: torch.Tensor, params: Sequence[SamplingParams], seen: torch.Tensor) -> torch.Tensor:
    """Turbo order: temperature -> top-k -> top-p -> penalty."""
    scores = logits.float()
    if not all(p.greedy for p in params):
        scores = top_p(top_k(temperature(scores, params), params), params)
    return repetition_penalty(scores, params, seen)


def draw(scores: torch.Tensor, params: Sequence[SamplingParams],
         generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row ``[B]``: the argmax for greedy rows, else a multinomial draw from the
    softmax with the row's generator (the global one when None)."""
    tokens = scores.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = scores[row : row + 1].softmax(dim=-1)
            tokens[row] = torch.multinomial(probs, num_samples=1, generator=gen)[0, 0]
    return tokens
