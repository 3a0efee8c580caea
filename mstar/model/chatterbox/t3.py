"""T3: Chatterbox's text-to-speech-token language model, on the paged KV cache.

T3 has no token vocabulary of its own in the backbone: it embeds text and speech tokens with
two tables (``text_emb``, ``speech_emb``), adds learned text and speech positions (Llama
variants), prepends the conditioning rows (``conditioning.py``) and reads speech logits from
``speech_head``. A request runs:

* prefill: ``[conditioning | text | start-of-speech]`` rows, ``prefill_embeds``;
* decode: one speech token per step, embedded by ``speech_embeds`` at its speech position.

The English and multilingual models run a classifier-free-guidance pair, two sequences of the
batch: the conditional row and an unconditional one whose text token embeddings are zero (the
text positions stay); their logits combine as ``cond + w * (cond - uncond)`` (``guide``).

Two quirks of the reference are kept, since the released weights were trained or tuned with
them: its guided loop appends the start-of-speech embedding (at speech position 0) a second
time after ``prepare_input_embeds`` has already placed one, so the prefill ends with two, and
the first decoded token sits at speech position 1; and Turbo's conditioning prompt rows get
no position (GPT-2 adds its own absolute ones to every row).

Parameter names are the released checkpoint's: ``tfmr.*`` the backbone (Llama from
``mstar.model.llama``, or GPT-2 from ``gpt2.py``), ``cond_enc.*``, ``text_emb``,
``speech_emb``, ``text_pos_emb.emb``, ``speech_pos_emb.emb``, ``speech_head``. The released
files also hold ``text_head`` (text logits, a training loss only), not built here.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.chatterbox.conditioning import T3CondEnc, T3Conditioning
from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.gpt2 import GPT2Model
from mstar.model.llama.modeling import LlamaModel, kv_cache_shape


class LearnedPositions(nn.Module):
    """A learned position table (``*.emb.weight`` in the checkpoint)."""

    def __init__(self, positions: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(positions, dim)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.emb(index)

    def first(self, length: int) -> torch.Tensor:
        """Rows for positions ``0 .. length - 1``."""
        return self.emb(torch.arange(length, device=self.emb.weight.device))


class T3(nn.Module):
    def __init__(self, config: T3Config) -> None:
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.tfmr = GPT2Model(config.backbone) if config.is_gpt2 else LlamaModel(config.backbone)
        self.cond_enc = T3CondEnc(config)
        self.text_emb = nn.Embedding(config.text_vocab_size, dim)
        self.speech_emb = nn.Embedding(config.speech_vocab_size, dim)
        if config.learned_positions:
            self.text_pos_emb = LearnedPositions(config.text_positions, dim)
            self.speech_pos_emb = LearnedPositions(config.speech_positions, dim)
        else:
            self.text_pos_emb = self.speech_pos_emb = None
        self.speech_head = nn.Linear(dim, config.speech_vocab_size, bias=config.is_gpt2)

    # ------------------------------------------------------------------ embeddings
    def conditioning(self, cond: T3Conditioning) -> torch.Tensor:
        """The conditioning rows ``[1, rows, hidden]`` of one voice."""
        device = self.speech_emb.weight.device
        tokens = cond.prompt_tokens.to(device).reshape(1, -1)
        prompt = self.speech_emb(tokens)
        if self.speech_pos_emb is not None:
            prompt = prompt + self.speech_pos_emb.first(tokens.shape[1])
        emotion = None
        if self.config.emotion_adv:
            emotion = torch.tensor([cond.emotion], dtype=prompt.dtype, device=device)
        speaker = cond.speaker_emb.to(device=device, dtype=prompt.dtype)
        return self.cond_enc(speaker, prompt, emotion)

    def text_embeds(self, text_ids: torch.Tensor, unconditional: bool = False) -> torch.Tensor:
        """Text rows ``[T, hidden]``; the unconditional row of a guided pair keeps only the
        positions."""
        ids = text_ids.to(self.text_emb.weight.device)
        rows = self.text_emb(ids)
        if unconditional:
            rows = torch.zeros_like(rows)
        if self.text_pos_emb is not None:
            rows = rows + self.text_pos_emb.first(ids.shape[0])
        return rows

    def speech_embeds(self, tokens: torch.Tensor, speech_positions: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, hidden]`` for speech ``tokens [N]`` at their speech positions ``[N]``
        (0 is the start-of-speech token; ignored by Turbo, whose backbone adds its own)."""
        device = self.speech_emb.weight.device
        rows = self.speech_emb(tokens.to(device))
        if self.speech_pos_emb is not None:
            rows = rows + self.speech_pos_emb(speech_positions.to(device))
        return rows

    def prefill_embeds(self, cond_rows: torch.Tensor, text_ids: torch.Tensor, guided: bool) -> torch.Tensor:
        """The prompt ``[rows, L, hidden]`` of one request: row 0 conditional, row 1 (``guided``)
        unconditional. ``cond_rows [1, C, hidden]`` from ``conditioning``; ``text_ids [T]``
        with the start / stop text tokens already in place (Turbo has none)."""
        device = self.speech_emb.weight.device
        start = torch.tensor([self.config.start_speech_token], device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        starts = self.speech_embeds(start, zero)
        if self.config.guided:  # the reference's guided loop appends its start token again
            starts = torch.cat([starts, starts])
        variants = (False, True) if guided else (False,)
        rows = [torch.cat([cond_rows[0], self.text_embeds(text_ids, unconditional=u), starts]) for u in variants]
        return torch.stack(rows)

    # ------------------------------------------------------------------ backbone
    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's flattened rows."""
        if self.config.is_gpt2:
            return self.tfmr(inputs_embeds, meta, kv_caches)
        return self.tfmr(None, meta, kv_caches, inputs_embeds)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.speech_head(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache."""
        if self.config.is_gpt2:
            return self.tfmr.cache_shape()
        return kv_cache_shape(self.config.backbone)


def guide(cond: torch.Tensor, uncond: torch.Tensor, weight: float) -> torch.Tensor:
    """Classifier-free guidance of the speech logits, as the reference combines them."""
    return cond + weight * (cond - uncond)
