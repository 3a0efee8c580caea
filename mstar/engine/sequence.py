"""A request's sequence in the autoregressive engine: its tokens, how far the KV cache holds
them, how its next tokens are sampled and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.contract import SamplingParams


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    computed: int = 0  # tokens whose K/V are in the cache
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    max_new_tokens: int = 1 << 30
    stop_ids: frozenset[int] = frozenset()
    request_id: str = ""
    state: Any = None  # the state its rules keep (``TokenRules.start``)
    order: int = 0  # when the engine took it in: the newest sequences are preempted first
    # The ``token`` output of its last step: the next decode's input is normally this very
    # tensor (the worker's store hands it back), which then needs no reading to be checked.
    written: torch.Tensor | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len
