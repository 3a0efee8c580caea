"""The unmasking schedule and one unmasking step of the OmniVoice canvas.

Generation fills a target of ``T`` frames x ``C`` codebook rows, all starting at the mask id,
over ``num_step`` forwards. Step ``s`` reveals ``ceil(C*T * (t[s+1] - t[s]))`` cells (the last
step whatever is left), where ``t`` is ``linspace(0, 1, num_step + 1)`` warped by
``t_shift * t / (1 + (t_shift - 1) * t)`` (a small shift reveals few cells early).

Each step runs the batch twice over: a conditional row (the full prompt, then the target) and an
unconditional row (the target alone). Classifier-free guidance mixes their log-probabilities
``lc + g * (lc - lu)``, renormalised; the mask id is never predicted. A cell's candidate is the
argmax (or, with ``class_temperature``, a Gumbel draw among the top 10 % of ids) and its score the
best log-probability, minus ``layer_penalty_factor`` per codebook row (coarse rows first); with
``position_temperature`` the scores are divided by it and perturbed by Gumbel noise. The ``k``
best-scoring cells still masked are revealed.

Randomness comes from a per-request ``torch.Generator`` (on the logits' device), so a request
draws the same noise alone or batched; its draws are in the same order and shape as
``torch.rand_like`` on the reference's global generator (class noise, then position noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UnmaskKnobs:
    """The sampling settings of one request (OmniVoice's generation defaults)."""

    num_step: int = 32
    guidance_scale: float = 2.0
    t_shift: float = 0.1
    layer_penalty_factor: float = 5.0
    position_temperature: float = 5.0
    class_temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.num_step < 1:
            raise ValueError(f"num_step must be at least 1, got {self.num_step}")
        if self.t_shift <= 0:
            raise ValueError(f"t_shift must be positive, got {self.t_shift}")
        if self.position_temperature < 0 or self.class_temperature < 0:
            raise ValueError("temperatures must not be negative")


def time_steps(num_step: int, t_shift: float) -> list[float]:
    """The ``num_step + 1`` warped times from 0 to 1."""
    t = torch.linspace(0.0, 1.0, num_step + 1)
    return (t_shift * t / (1 + (t_shift - 1) * t)).tolist()


def unmask_counts(cells: int, num_step: int, t_shift: float) -> list[int]:
    """How many of ``cells`` masked cells each step reveals (they sum to ``cells``)."""
    t = time_steps(num_step, t_shift)
    left, counts = cells, []
    for step in range(num_step):
        n = left if step == num_step - 1 else min(math.ceil(cells * (t[step + 1] - t[step])), left)
        counts.append(int(n))
        left -= int(n)
    return counts


def gumbel(scores: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """``scores / temperature`` plus Gumbel(0, 1) noise drawn from ``generator``."""
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=scores.dtype)
    return scores / temperature - torch.log(-torch.log(u + 1e-10) + 1e-10)


def top_fraction(log_probs: torch.Tensor, ratio: float = 0.1) -> torch.Tensor:
    """Keep the top ``ceil(ratio * V)`` entries of the last axis, the rest ``-inf``."""
    k = math.ceil(ratio * log_probs.shape[-1])
    values, index = log_probs.topk(k, dim=-1)
    return torch.full_like(log_probs, float("-inf")).scatter(-1, index, values)


def predict(cond: torch.Tensor, uncond: torch.Tensor, knobs: UnmaskKnobs, mask_id: int,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate ids and their scores ``[C, T]`` from the two logit sets ``[C, T, V]``."""
    if knobs.guidance_scale != 0:
        lc, lu = cond.log_softmax(-1), uncond.log_softmax(-1)
        log_probs = (lc + knobs.guidance_scale * (lc - lu)).log_softmax(-1)
    else:
        log_probs = cond.log_softmax(-1)
    log_probs[..., mask_id] = float("-inf")
    if knobs.class_temperature > 0:
        noisy = gumbel(top_fraction(log_probs), knobs.class_temperature, generator)
        ids = noisy.argmax(-1)
    else:
        ids = log_probs.argmax(-1)
    return ids, log_probs.max(-1).values


def unmask_step(target: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, count: int,
                knobs: UnmaskKnobs, mask_id: int,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The target ``[C, T]`` with ``count`` more cells revealed (a new tensor)."""
    if count <= 0:
        return target
    ids, scores = predict(cond, uncond, knobs, mask_id, generator)
    rows = torch.arange(target.shape[0], device=scores.device)[:, None]
    scores = scores - rows * knobs.layer_penalty_factor
    if knobs.position_temperature > 0:
        scores = gumbel(scores, knobs.position_temperature, generator)
    scores = scores.masked_fill(target != mask_id, float("-inf"))
    chosen = scores.flatten().topk(count).indices
    out = target.flatten().clone()
    out[chosen] = ids.flatten()[chosen]
    return out.view_as(target)
