"""Shared by ``tests/speech_front`` and its ``record_reference.py`` (which runs in another
environment, so this imports only numpy and torch): the test clips and seeded tiny weights.

The weights are not stored in the fixtures: both sides draw them from numpy's legacy
``RandomState`` (its streams are frozen across numpy versions), key by key in the order the
reference's state dict lists them, so the fixtures hold only names, shapes and outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "speech_front" / "fixtures"


def seeded_state(shapes: dict[str, list[int]], seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors for ``shapes`` (name -> shape, in state-dict order): matrices and conv
    kernels ``N(0, 1 / fan_in)``, norm scales around 1, BatchNorm variances in [0.5, 1.5),
    other vectors ``N(0, 0.1)``; ``num_batches_tracked`` zero."""
    rng = np.random.RandomState(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("num_batches_tracked"):
            state[name] = torch.zeros((), dtype=torch.long)
            continue
        if name.endswith("running_var"):
            values = 0.5 + rng.random_sample(shape)
        elif len(shape) >= 2:
            values = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        elif name.endswith("weight") and ("ln" in name or "bn" in name or "norm" in name):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = 0.1 * rng.standard_normal(shape)
        state[name] = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))
    return state


def clips() -> list[torch.Tensor]:
    """The stored test clips (16 kHz, float32 from int16 PCM, so identical everywhere)."""
    pcm = torch.load(FIXTURES / "clips.pt")
    return [p.to(torch.float32) / 32768.0 for p in pcm]


def long_clip(clip: torch.Tensor, seconds: float) -> torch.Tensor:
    """``clip`` tiled with alternating sign to at least ``seconds`` (exact in float32)."""
    reps = int(np.ceil(seconds * 16000 / clip.shape[0]))
    return torch.cat([clip if i % 2 == 0 else -clip for i in range(reps)])


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, relative to the reference's peak magnitude."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()
