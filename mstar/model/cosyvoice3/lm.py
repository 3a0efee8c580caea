"""CosyVoice's speech-token LM: a Qwen2 backbone reading text embeddings and writing speech
tokens through its own speech embedding and head.

The prompt of a request is one sequence of input embeddings::

    [sos] [text embeddings of prompt_text + text] [task] [speech embeddings of the prompt tokens]

and each decoded token goes back in through the speech embedding. The text rows come from the
backbone's own token embedding (``model.embed_tokens``); the speech head (``llm_decoder``)
reads the backbone's final-normed hidden state. The two released layouts differ only in where
the special tokens live (``SpeechLMConfig``):

* **CosyVoice3** (``CosyVoice3LM``): the speech vocabulary has 200 extra rows after the
  ``speech_token_size`` speech tokens; ``sos``, ``eos`` and ``task`` are the first three, every
  extra row stops decoding, and the head has no bias.
* **CosyVoice2** (``Qwen2LM``): three extra rows (``eos`` first); ``sos`` and ``task`` are the
  two rows of a separate ``llm_embedding``, and the head has a bias.

The backbone runs one paged step per ``forward`` (``mstar.model.llama.modeling``), so prefill
and decode rows of many requests batch together; ``step_inputs`` builds a step's embeddings.
Parameter names are the released ``llm.pt``'s (``checkpoint.llm_name_map``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.cosyvoice3.qwen2 import Qwen2Backbone
from mstar.model.llama.config import LlamaConfig

__all__ = ["SpeechLM", "SpeechLMConfig", "length_bounds"]


@dataclass(frozen=True)
class SpeechLMConfig:
    """The speech side of the LM; the defaults are Fun-CosyVoice3-0.5B's."""

    backbone: LlamaConfig
    speech_token_size: int = 6561
    layout: Literal["cosyvoice3", "cosyvoice2"] = "cosyvoice3"
    endofprompt_id: int | None = 151646  # CosyVoice3's text must hold <|endofprompt|>; None: no check
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    def __post_init__(self) -> None:
        if self.layout not in ("cosyvoice3", "cosyvoice2"):
            raise ValueError(f"layout: expected 'cosyvoice3' or 'cosyvoice2', got {self.layout!r}")

    @property
    def extra_tokens(self) -> int:
        return 200 if self.layout == "cosyvoice3" else 3

    @property
    def speech_vocab(self) -> int:
        """Rows of ``speech_embedding`` and outputs of ``llm_decoder``."""
        return self.speech_token_size + self.extra_tokens

    @property
    def eos_id(self) -> int:
        return self.speech_token_size + (1 if self.layout == "cosyvoice3" else 0)

    @property
    def stop_ids(self) -> range:
        """Every id past the speech tokens ends the sequence (the reference's ``stop_token_ids``)."""
        return range(self.speech_token_size, self.speech_vocab)


def length_bounds(config: SpeechLMConfig, text_tokens: int) -> tuple[int, int]:
    """``(min, max)`` speech tokens for ``text_tokens`` tokens of text to speak (the prompt's
    transcript not counted): stop tokens are banned before the minimum, decoding ends at the
    maximum."""
    return int(text_tokens * config.min_token_text_ratio), int(text_tokens * config.max_token_text_ratio)


class SpeechLM(nn.Module):
    def __init__(self, config: SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.backbone.hidden_size
        self.llm = Qwen2Backbone(config.backbone)
        self.speech_embedding = nn.Embedding(config.speech_vocab, hidden)
        self.llm_decoder = nn.Linear(hidden, config.speech_vocab, bias=config.layout == "cosyvoice2")
        if config.layout == "cosyvoice2":
            self.llm_embedding = nn.Embedding(2, hidden)  # rows: sos, task

    def special_embedding(self, which: Literal["sos", "task"]) -> torch.Tensor:
        """The ``[hidden]`` input row of the sequence start or of the task marker."""
        if self.config.layout == "cosyvoice2":
            return self.llm_embedding.weight[0 if which == "sos" else 1]
        offset = 0 if which == "sos" else 2
        return self.speech_embedding.weight[self.config.speech_token_size + offset]

    def prompt_embeddings(self, text_ids: torch.Tensor, prompt_speech: torch.Tensor) -> torch.Tensor:
        """The prefill rows ``[1 + len(text_ids) + 1 + len(prompt_speech), hidden]`` of one
        request: ``text_ids`` are the prompt transcript's tokens followed by the text to speak,
        ``prompt_speech`` the reference clip's speech tokens (may be empty)."""
        end = self.config.endofprompt_id
        if self.config.layout == "cosyvoice3" and end is not None and not bool((text_ids == end).any()):
            raise ValueError(f"CosyVoice3 text must contain <|endofprompt|> (token {end}) in the prompt "
                             "text or the text")
        text = self.llm.embed_input_ids(text_ids)
        speech = self.speech_embedding(prompt_speech)
        return torch.cat([self.special_embedding("sos")[None].to(text.dtype), text,
                          self.special_embedding("task")[None].to(text.dtype), speech.to(text.dtype)])

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decode rows ``[N, hidden]`` of the last sampled speech tokens ``[N]``."""
        return self.speech_embedding(tokens)

    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of one paged step's rows."""
        return self.llm(None, meta, kv_caches, inputs_embeds=inputs_embeds)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token logits ``[N, speech_vocab]`` of hidden states ``[N, hidden]``."""
        return self.llm_decoder(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        return self.llm.cache_shape()

    def step_inputs(self, prompts: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                    last_tokens: Sequence[int | None]) -> torch.Tensor:
        """A step's rows, request by request: a prefill where ``prompts[i]`` is given (its
        ``(text_ids, prompt_speech)``), else the decode row of ``last_tokens[i]``."""
        rows = []
        for prompt, token in zip(prompts, last_tokens):
            if prompt is not None:
                rows.append(self.prompt_embeddings(*prompt))
            else:
                assert token is not None
                rows.append(self.token_embeddings(torch.tensor([token], device=self.speech_embedding.weight.device)))
        return torch.cat(rows)
