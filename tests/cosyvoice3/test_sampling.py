"""Repetition-aware sampling (``mstar.model.cosyvoice3.sampling``) against the reference's
``ras_sampling``: CosyVoice2's live (``cosyvoice-minicpmo==0.1.0``, installed in the project
venv; its fallback draw keeps the repeated token) and CosyVoice3's recorded by
``record_reference.py`` (the official code at ace7c47, which removes it). Same seed, same
scores, same history: the same tokens, step after step."""

from __future__ import annotations

import torch

from mstar.model.cosyvoice3 import RasParams, drop_long_silences, ras_sample, sample_speech_token


def run(logps: torch.Tensor, seed: int, params: RasParams) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    history: list[int] = []
    for logp in logps:
        history.append(ras_sample(logp, history, params, generator))
    return history


def test_matches_cosyvoice2_ras_sampling_live() -> None:
    from cosyvoice.utils.common import ras_sampling

    fallbacks = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(200 + seed)
        logps = [torch.log_softmax(3.0 * torch.randn(60, generator=g), dim=0) for _ in range(40)]
        torch.manual_seed(seed)
        want: list[int] = []
        for logp in logps:
            want.append(int(ras_sampling(logp.clone(), want, 25)))
        fallbacks += sum(1 for i, t in enumerate(want) if t in want[max(0, i - 10):i])
        assert run(torch.stack(logps), seed, RasParams(exclude_repeated=False)) == want
    assert fallbacks > 0  # the repetition branch ran


def test_matches_cosyvoice3_ras_sampling_recorded(reference) -> None:
    ras = reference["ras"]
    params = RasParams(**ras["params"], exclude_repeated=True)
    for case in ras["runs"]:
        assert run(case["logp"], case["seed"], params) == case["tokens"]


def test_excluded_repeat_and_banned_tokens_are_never_drawn() -> None:
    logp = torch.full((8,), -20.0)
    logp[3] = 0.0  # nearly all mass on token 3, which the history repeats
    generator = torch.Generator().manual_seed(0)
    draws = [ras_sample(logp, [3], RasParams(exclude_repeated=True), generator) for _ in range(50)]
    assert 3 not in draws
    draws = [sample_speech_token(logp, [], RasParams(), generator, banned=[3]) for _ in range(50)]
    assert 3 not in draws


def test_long_silences_are_cut_to_five() -> None:
    silent = frozenset({1, 2})
    tokens = [7, 1, 2, 1, 1, 2, 1, 1, 9, 2, 2, 8]
    assert drop_long_silences(tokens, silent) == [7, 1, 2, 1, 1, 2, 9, 2, 2, 8]
