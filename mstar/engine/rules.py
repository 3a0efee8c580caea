"""What a model decides about its tokens beyond sampling them: the autoregressive engine's
rules object.

``TokenRules`` is the plain LLM's: every token is sampled, and a step writes its ``token``
alone. A model with rules of its own subclasses it and hands an instance to the engine
(``AutoregressiveEngine(..., rules=...)``): Orpheus's talker masks the logits to the audio
codes of a position and writes each token's ``code``; Whisper forces its task tokens, picks
a language, and suppresses tokens text never contains. The engine reads from the rules what
its fast paths may do: overlap scheduling launches a row's next step before the host has seen
its token only where ``may_run_ahead`` says the choice needs nothing from the host, and the
``token`` output is a view of the step's ids unless ``extra_outputs`` asks for ``outputs``
(each step) and ``last_outputs`` (a sequence's last step).

A sequence's state under the rules (``start``) lives on its ``Sequence`` and goes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mstar.engine.sequence import Sequence

# The engine's sampler: each row's next id from its logits (seeded generators, repetition
# penalties, and the same ids on every tensor-parallel rank), left on the logits' device.
Sample = Callable[[torch.Tensor, list[Sequence]], torch.Tensor]


class TokenRules:
    """Every token sampled; a step writes ``token`` alone."""

    extra_outputs = False  # whether a step writes ports besides ``token`` (``outputs``)

    def start(self, params: dict[str, Any]) -> Any:
        """A new sequence's state (``Sequence.state``) from its request's params."""
        return None

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        """Each row's next id ``[B]``, left on the logits' device. ``lead``: how many tokens
        the step is ahead of the sequences' host state (1 for a step launched ahead by
        overlap scheduling, which holds only rows ``may_run_ahead`` accepted)."""
        return sample(logits, seqs)

    def may_run_ahead(self, seq: Sequence) -> bool:
        """Whether the sequence's next token may be chosen before the host has seen the one
        in flight (besides the engine's own conditions)."""
        return True

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        """The ports a step writes besides ``token`` (called for every row when
        ``extra_outputs``); leaving a port out keeps it silent that step."""
        return {}

    def last_outputs(self, seq: Sequence) -> dict[str, torch.Tensor]:
        """The ports a sequence's last step writes besides ``token`` and ``outputs`` (called
        once, as it stops, when ``extra_outputs``): what the rules summed up over the sequence."""
        return {}

    def release(self, request_id: str) -> None:
        """The engine let the sequence go: drop what the rules hold for it beyond its state."""
