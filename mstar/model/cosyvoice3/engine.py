"""The speech-token LM on the autoregressive engine: its token rules and request parameters.

``SpeechLM`` follows the engine's decoder protocol (ids in, speech logits out), so the engine
runs it with its plain ``Forward``; what is CosyVoice's own is how a token is chosen.
``RasRules`` replaces the engine's sampler with repetition-aware sampling: it needs the
tokens a row has sampled so far, so no row's token is chosen before the host has seen the one
in flight (``may_run_ahead`` is False), and each request draws from its own CPU generator,
seeded from its ``seed`` parameter, so a request samples the same tokens alone or batched.
Before a request's ``min_new_tokens`` its stop ids are banned; the engine itself stops a row
at a stop id or at ``max_new_tokens`` (``lm_params`` sets both from the text's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.model.cosyvoice3.lm import SpeechLMConfig, length_bounds
from mstar.model.cosyvoice3.sampling import RasParams, sample_speech_token

__all__ = ["RasRules", "RasState", "lm_params"]


@dataclass
class RasState:
    generator: torch.Generator
    min_new_tokens: int


def lm_params(config: SpeechLMConfig, text_tokens: int, seed: int | None = None) -> dict[str, Any]:
    """The engine parameters of a request speaking ``text_tokens`` tokens of text."""
    min_len, max_len = length_bounds(config, text_tokens)
    return {"max_new_tokens": max_len, "min_new_tokens": min_len, "stop_token_ids": list(config.stop_ids),
            "seed": seed}


class RasRules(TokenRules):
    def __init__(self, params: RasParams | None = None) -> None:
        self.params = params or RasParams()

    def start(self, params: dict[str, Any]) -> RasState:
        generator = torch.Generator()
        seed = params.get("seed")
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
        return RasState(generator, int(params.get("min_new_tokens", 0)))

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        logp = logits.float().log_softmax(-1).cpu()
        ids = []
        for row, seq in zip(logp, seqs):
            history = seq.tokens[seq.prompt_len:]
            banned = sorted(seq.stop_ids) if seq.generated < seq.state.min_new_tokens else ()
            ids.append(sample_speech_token(row, history, self.params, seq.state.generator, banned=banned))
        return torch.tensor(ids, device=logits.device)

    def may_run_ahead(self, seq: Sequence) -> bool:
        return False
