"""T3's filters against the transformers logits processors the reference chains, live.

The reference builds its filters from ``transformers.generation.logits_process`` (the project
venv has them: transformers 5.25; the recorded decode used 5.2, whose processors are the same
maths). Each order is checked on random logits with per-row histories, rows batched with
different parameters; the seeded decode in ``test_t3_parity.py`` pins the whole loop.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mstar.contract import SamplingParams
from mstar.engine.sampler import seen_mask
from mstar.model.chatterbox import sampling

VOCAB = 97


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _histories(rows: int) -> list[list[int]]:
    return [[(7 * r + 3 * i) % VOCAB for i in range(5 + r)] for r in range(rows)]


def _guided_reference(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([history])
    scores = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(ids, logits[None].clone())
    if p.temperature != 1.0:
        scores = scores / p.temperature
    scores = MinPLogitsWarper(min_p=p.min_p)(ids, scores)
    return TopPLogitsWarper(top_p=p.top_p)(ids, scores)[0]


def _turbo_reference(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([history])
    scores = logits[None].clone()
    if p.temperature != 1.0:
        scores = scores / p.temperature
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)[0]


GUIDED = [
    SamplingParams(temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=1.2),  # the English defaults
    SamplingParams(temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=2.0),  # the multilingual ones
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.2, repetition_penalty=1.0),
    SamplingParams(temperature=0.5, top_p=0.5, min_p=0.0, repetition_penalty=1.5),
]
TURBO = [
    SamplingParams(temperature=0.8, top_k=1000, top_p=0.95, repetition_penalty=1.2),  # the Turbo defaults
    SamplingParams(temperature=1.0, top_k=10, top_p=1.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.6, top_k=0, top_p=0.7, repetition_penalty=1.0),
]


@pytest.mark.parametrize("order, rows, reference", [
    (sampling.guided_scores, GUIDED, _guided_reference),
    (sampling.turbo_scores, TURBO, _turbo_reference),
])
def test_filter_order_matches_the_processors(order, rows, reference):
    logits = _logits(len(rows), seed=len(rows))
    histories = _histories(len(rows))
    ours = order(logits, rows, seen_mask(histories, VOCAB))
    for r, params in enumerate(rows):
        expected = reference(logits[r], histories[r], params)
        assert torch.equal(torch.isinf(ours[r]), torch.isinf(expected)), f"row {r}: a different set survives"
        kept = ~torch.isinf(expected)
        assert kept.sum() < VOCAB or params.top_p == 1.0 and params.min_p == 0.0
        assert (ours[r][kept] - expected[kept]).abs().max().item() < 1e-6


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    logits = _logits(1, seed=5)
    top = int(logits.argmax())
    params = [SamplingParams(temperature=0.0, repetition_penalty=100.0)]
    scores = sampling.guided_scores(logits, params, seen_mask([[top]], VOCAB))
    token = int(sampling.draw(scores, params, [None])[0])
    assert token != top and token == int(scores.argmax())
