"""S2's sampling on the device: a grid of numbers through the inverse CDF lands on each id as
often as fish-speech's truncated, tempered distribution says, rows batched draw what they draw
alone, and a greedy row takes the argmax."""

from __future__ import annotations

import torch

from mstar.model.fish_s2_pro.sampling import RowSampling, Sampling, draw_rows


def reference_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """fish-speech's ``logits_to_probs`` (S2), written out over the ids in their own order."""
    ordered, ids = logits.sort(descending=True)
    total = ordered.softmax(-1).cumsum(-1)
    drop = (total > s.top_p) | (torch.arange(len(ordered)) >= s.top_k)
    drop[0] = False
    probs = (ordered.masked_fill(drop, float("-inf")) / s.temperature).softmax(-1)
    return torch.zeros_like(probs).scatter(0, ids, probs)


def test_a_grid_of_numbers_follows_the_distribution():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 2
    for s in (Sampling(temperature=0.7, top_p=0.8, top_k=30), Sampling(temperature=1.3, top_p=0.95, top_k=5)):
        grid = (torch.arange(20000) + 0.5) / 20000
        row = RowSampling(s, torch.Generator())
        drawn = draw_rows(logits.expand(len(grid), -1), [row] * len(grid), grid)
        seen = torch.bincount(drawn, minlength=40).float() / len(grid)
        expected = reference_probs(logits, s)
        assert (seen - expected).abs().max() <= 1e-4
        assert set(drawn.tolist()) == set(expected.nonzero()[:, 0].tolist())


def test_batched_rows_draw_what_they_draw_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g)
    rows = [RowSampling(Sampling(temperature=0.5 + 0.2 * i, top_p=0.6 + 0.05 * i, top_k=5 + 10 * i,
                                 greedy=i == 3), torch.Generator()) for i in range(6)]
    uniforms = torch.rand(6, generator=g)
    together = draw_rows(logits, rows, uniforms)
    alone = [int(draw_rows(logits[i:i + 1], [rows[i]], uniforms[i:i + 1])[0]) for i in range(6)]
    assert together.tolist() == alone
    assert alone[3] == int(logits[3].argmax())
