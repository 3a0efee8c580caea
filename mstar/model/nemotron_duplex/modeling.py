"""The duplex model's input-side modules: the streamed speech encoder with its projection to
the LLM's width, and the nano LLM (Nemotron-H)."""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.fastconformer.encoder import FastConformerEncoder
from mstar.model.nemotron_duplex.config import DuplexConfig
from mstar.model.nemotron_h.modeling import NemotronHForCausalLM


class SpeechEncoder(nn.Module):
    """FastConformer frames, projected to LLM embeddings (one per 80 ms)."""

    def __init__(self, config: DuplexConfig) -> None:
        super().__init__()
        self.encoder = FastConformerEncoder(config.encoder)
        self.proj = nn.Linear(config.encoder.hidden_size, config.llm.hidden_size)
        self.user_weight = config.user_channel_weight

    def project(self, frames: torch.Tensor) -> torch.Tensor:
        """Encoder frames ``[T, hidden]`` as the LLM's user-channel embeddings."""
        return self.proj(frames) * self.user_weight

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """The offline pass: ``[T', llm hidden]`` of one call's log-mels ``[T, mel]``."""
        frames, _ = self.encoder(mel[None], lookahead=0)
        return self.project(frames[0])


class DuplexLLM(NemotronHForCausalLM):
    """The nano LLM with the release's optional tool-call head (``function_head``, a linear
    over the final-normed hidden state to the text vocabulary, ``use_function_head``).

    With the head, ``compute_logits`` returns ``[T, 2 V]``: the text logits, then the tool-call
    logits (``DuplexRules`` splits them); without it, the text logits alone."""

    def __init__(self, config, *, function_head: bool = False) -> None:
        super().__init__(config)
        self.function_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if function_head else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        text = super().compute_logits(hidden)
        if self.function_head is None:
            return text
        return torch.cat([text, self.function_head(hidden).float()], dim=-1)


def build_models(config: DuplexConfig) -> tuple[SpeechEncoder, DuplexLLM]:
    return SpeechEncoder(config), DuplexLLM(config.llm, function_head=config.use_function_head)
