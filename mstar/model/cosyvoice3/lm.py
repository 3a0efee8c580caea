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
and decode rows of many requests batch together. Prompts are ids in one id space
(``SpeechLM.prompt_ids``), so the autoregressive engine drives the LM like any decoder, with
``engine.RasRules`` choosing its tokens.
Parameter names are the released ``llm.pt``'s (``checkpoint.llm_name_map``).
"""

from __future__ import annotations

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
    """The LM over one id space, so that a prompt is a list of ids like any decoder's (the
    autoregressive engine's ``prompt_ids``, prefix caching and preemption work unchanged):
    ids below ``speech_vocab`` are speech rows (the sampled tokens feed straight back), the
    next ``vocab_size`` ids are text tokens, and in CosyVoice2's layout the last two are its
    separate ``sos`` and ``task`` rows."""

    def __init__(self, config: SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.backbone.hidden_size
        self.llm = Qwen2Backbone(config.backbone)
        self.speech_embedding = nn.Embedding(config.speech_vocab, hidden)
        self.llm_decoder = nn.Linear(hidden, config.speech_vocab, bias=config.layout == "cosyvoice2")
        if config.layout == "cosyvoice2":
            self.llm_embedding = nn.Embedding(2, hidden)  # rows: sos, task

    @property
    def text_offset(self) -> int:
        """The id of text token 0."""
        return self.config.speech_vocab

    def special_id(self, which: Literal["sos", "task"]) -> int:
        """The id of the sequence start or of the task marker."""
        if self.config.layout == "cosyvoice2":
            return self.text_offset + self.config.backbone.vocab_size + (0 if which == "sos" else 1)
        return self.config.speech_token_size + (0 if which == "sos" else 2)

    def prompt_ids(self, text_ids: torch.Tensor, prompt_speech: torch.Tensor) -> torch.Tensor:
        """The prefill ids ``[1 + len(text_ids) + 1 + len(prompt_speech)]`` of one request:
        ``sos``, ``text_ids`` (the prompt transcript's tokens followed by the text to speak),
        ``task``, then ``prompt_speech`` (the reference clip's speech tokens, may be empty)."""
        end = self.config.endofprompt_id
        if self.config.layout == "cosyvoice3" and end is not None and not bool((text_ids == end).any()):
            raise ValueError(f"CosyVoice3 text must contain <|endofprompt|> (token {end}) in the prompt "
                             "text or the text")
        device = text_ids.device
        return torch.cat([torch.tensor([self.special_id("sos")], device=device), text_ids.long() + self.text_offset,
                          torch.tensor([self.special_id("task")], device=device), prompt_speech.long()])

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Input rows ``[T, hidden]`` of ids ``[T]`` in the LM's id space."""
        speech_vocab, text_vocab = self.config.speech_vocab, self.config.backbone.vocab_size
        speech = ids < speech_vocab
        text = ~speech & (ids < speech_vocab + text_vocab)
        rows = self.speech_embedding(ids.clamp(max=speech_vocab - 1))
        if bool(text.any()):
            rows = torch.where(text[:, None], self.llm.embed_input_ids((ids - speech_vocab).clamp(0, text_vocab - 1))
                               .to(rows.dtype), rows)
        if self.config.layout == "cosyvoice2":
            special = ids >= speech_vocab + text_vocab
            if bool(special.any()):
                which = (ids - speech_vocab - text_vocab).clamp(0, 1)
                rows = torch.where(special[:, None], self.llm_embedding(which).to(rows.dtype), rows)
        return rows

    def prompt_embeddings(self, text_ids: torch.Tensor, prompt_speech: torch.Tensor) -> torch.Tensor:
        """The prefill rows of ``prompt_ids``."""
        return self.embed_ids(self.prompt_ids(text_ids, prompt_speech))

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decode rows ``[N, hidden]`` of the last sampled speech tokens ``[N]``."""
        return self.speech_embedding(tokens)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of one paged step's rows, from their ids
        or, when given, their input rows ``inputs_embeds``."""
        rows = inputs_embeds if inputs_embeds is not None else self.embed_ids(input_ids)
        return self.llm(None, meta, kv_caches, inputs_embeds=rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token logits ``[N, speech_vocab]`` of hidden states ``[N, hidden]``."""
        return self.llm_decoder(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        return self.llm.cache_shape()

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """The backbone's fused element-wise kernels on or off (``decode_engine`` asks)."""
        self.llm.use_fused_kernels(enabled)
