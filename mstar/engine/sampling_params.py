"""Per-request sampling parameters (torch-free, shared by the server and the engine)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How one request picks its next token.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters; ``repetition_penalty == 1`` disables the penalty.
    ``seed`` makes a request's samples reproducible whatever it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
