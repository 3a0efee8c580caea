"""Speech-token sampling of the CosyVoice LMs: repetition-aware sampling (RAS).

Each step first draws from the nucleus: the most probable tokens, in order, while their
running probability is still below ``top_p`` and fewer than ``top_k`` are taken (so the token
that crosses ``top_p`` is included). If the drawn token already occurs at least
``win_size * tau_r`` times among the last ``win_size`` tokens, the step draws again from the
whole distribution instead, which breaks the loops a speech-token LM otherwise falls into
(one repeated token is a held sound). CosyVoice3's code also removes the rejected token from
that second draw; CosyVoice2's release (``cosyvoice-minicpmo``) does not: ``exclude_repeated``.

Draws use the request's own ``torch.Generator`` on the CPU, so a seeded request samples the
same tokens whichever other requests share its batch. With the same seed the draws are those
of the reference functions seeded through ``torch.manual_seed`` (same probabilities, same
``multinomial`` calls, in the same order). The running sum is kept in float32 one token at a
time, as the reference does: a vectorised ``cumsum`` may round differently at the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RasParams", "drop_long_silences", "nucleus_sample", "ras_sample", "sample_speech_token"]


@dataclass(frozen=True)
class RasParams:
    """The released ``sampling`` settings of CosyVoice2/3 (``cosyvoice3.yaml``)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    exclude_repeated: bool = True  # CosyVoice3; False reproduces CosyVoice2's release

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 or self.win_size < 1:
            raise ValueError(f"top_k and win_size must be >= 1, got {self.top_k} and {self.win_size}")


def nucleus_sample(logp: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """One token of the nucleus of the scores ``logp`` ``[V]`` (log-probabilities or logits)."""
    probs, order = logp.float().softmax(dim=0).sort(descending=True, stable=True)
    head = probs[:top_k].cpu()
    cut = torch.tensor(top_p, dtype=torch.float32)
    running = torch.zeros((), dtype=torch.float32)
    taken = 0
    for p in head:  # at most top_k tokens: the reference's float32 running sum and comparison
        if not running < cut:
            break
        running = running + p
        taken += 1
    pick = torch.multinomial(head[:taken], 1, replacement=True, generator=generator)
    return int(order[int(pick)])


def ras_sample(logp: torch.Tensor, history: Sequence[int], params: RasParams, generator: torch.Generator) -> int:
    """One speech token from the scores ``logp`` ``[V]`` given the tokens decoded so far."""
    token = nucleus_sample(logp, params.top_p, params.top_k, generator)
    repeats = sum(1 for t in history[-params.win_size:] if t == token)
    if repeats >= params.win_size * params.tau_r:
        scores = logp.float().cpu().clone()
        if params.exclude_repeated:
            scores[token] = -float("inf")
        token = int(torch.multinomial(scores.softmax(dim=0), 1, replacement=True, generator=generator))
    return token


def sample_speech_token(logp: torch.Tensor, history: Sequence[int], params: RasParams, generator: torch.Generator,
                        banned: Sequence[int] = ()) -> int:
    """``ras_sample`` with the ``banned`` tokens (the stop tokens before the minimum length)
    removed from the scores first."""
    if banned:
        logp = logp.float().cpu().clone()
        logp[list(banned)] = -float("inf")
    return ras_sample(logp, history, params, generator)


def drop_long_silences(tokens: Sequence[int], silent: frozenset[int], max_run: int = 5) -> list[int]:
    """The tokens with every silent token past the first ``max_run`` of a run left out:
    CosyVoice3's driver keeps at most five consecutive silence or breath tokens, so a long
    pause the LM produces is shortened before the flow hears it."""
    kept, run = [], 0
    for token in tokens:
        run = run + 1 if token in silent else 0
        if run <= max_run:
            kept.append(token)
    return kept
