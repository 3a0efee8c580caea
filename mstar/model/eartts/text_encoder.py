"""The talker's character-aware text encoder, run once at load time into ``TextTable``.

The released talker embeds an agent text token from its characters (NeMo's
``CharAwareSubwordEncoder``): the token's characters, as ids of the tokenizer's single-
character tokens, go through a bidirectional T5-Gemma encoder, are mean-pooled and projected
to the talker's width; a continuation flag (the token does not start a word) and a BOS/EOS
flag add embeddings of their own. All of it is a function of the token id, so the engine
never runs it: ``build_tables`` computes, for every id, the embedding of the token spoken
(``on``) and of a masked warm-up position (``off``: the flags alone).

The encoder is transformers' ``T5GemmaEncoderModel`` (what the reference instantiates), its
own token embedding removed; names follow the checkpoint's ``embed_subword.*``. The flags
are buffers of the checkpoint; the character map is rebuilt from the tokenizer's vocabulary
as the reference does (``build_vocabs``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def char_map(vocab: dict[str, int]) -> tuple[dict[int, tuple[int, ...]], int]:
    """Each token id's character ids (its characters that are single-character tokens,
    numbered in token-id order), and the character count (the padding character's id)."""
    singles = sorted((tok for tok in vocab if len(tok) == 1), key=vocab.__getitem__)
    chars = {c: i for i, c in enumerate(singles)}
    mapping = {tid: tuple(chars[c] for c in tok if c in chars) for tok, tid in vocab.items()}
    return {tid: ids for tid, ids in mapping.items() if ids}, len(chars)


class _ContinuationFlag(nn.Module):
    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("is_continuation", torch.zeros(rows, dtype=torch.long))
        self.register_buffer("pad_tensor", torch.tensor(rows - 1, dtype=torch.long))
        self.cont_emb = nn.Embedding(2, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        safe = torch.where(ids >= self.pad_tensor, self.pad_tensor, ids)
        return self.cont_emb(self.is_continuation[safe])


class _SpecialFlag(nn.Module):
    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("special_flags", torch.zeros(rows, dtype=torch.long))
        self.register_buffer("pad_tensor", torch.tensor(rows - 1, dtype=torch.long))
        self.special_emb = nn.Embedding(3, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        safe = torch.where(ids >= self.pad_tensor, self.pad_tensor, ids)
        return self.special_emb(self.special_flags[safe])


class CharAwareEncoder(nn.Module):
    def __init__(self, cas_config: dict[str, Any], out_size: int, char_rows: int, flag_rows: int,
                 special_rows: int) -> None:
        """Row counts as the checkpoint holds them: ``char_rows`` characters plus padding,
        ``flag_rows``/``special_rows`` the two flag tables (their last row: padding)."""
        super().__init__()
        from transformers import AutoConfig, AutoModelForTextEncoding

        if cas_config.get("backbone_type", "t5gemma") != "t5gemma":
            raise ValueError(f"cas_config.backbone_type {cas_config.get('backbone_type')!r}: only t5gemma is ported")
        config = AutoConfig.for_model("t5gemma", **dict(cas_config.get("backbone_config") or {}))
        self.backbone = AutoModelForTextEncoding.from_config(config).eval()
        del self.backbone.encoder.embed_tokens
        hidden = config.encoder.hidden_size
        self.embed_tokens = nn.Embedding(char_rows, hidden, padding_idx=char_rows - 1)
        self.proj_embedding = nn.Linear(hidden, out_size, bias=False)
        self.subword_flag_emb = _ContinuationFlag(flag_rows, hidden)
        self.bos_eos_emb = _SpecialFlag(special_rows, hidden)

    @torch.no_grad()
    def build_tables(self, chars: dict[int, tuple[int, ...]], rows: int, batch: int = 512
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``on``/``off`` tables ``[rows, out]`` for token ids ``0 .. rows - 1`` (a token with
        no known character pools nothing: its ``on`` is its flags alone)."""
        pad_char = self.embed_tokens.num_embeddings - 1
        ids = torch.arange(rows)
        off = self.subword_flag_emb(ids) + self.bos_eos_emb(ids)
        pooled = torch.zeros(rows, self.proj_embedding.out_features)
        known = sorted((tid for tid in range(rows) if tid in chars), key=lambda t: len(chars[t]))
        for start in range(0, len(known), batch):
            group = known[start:start + batch]
            lengths = torch.tensor([len(chars[t]) for t in group])
            char_ids = torch.full((len(group), int(lengths.max())), pad_char, dtype=torch.long)
            for row, tid in enumerate(group):
                char_ids[row, : len(chars[tid])] = torch.tensor(chars[tid])
            mask = torch.arange(char_ids.shape[1])[None] < lengths[:, None]
            hidden = self.backbone(inputs_embeds=self.embed_tokens(char_ids), attention_mask=mask).last_hidden_state
            mean = (hidden * mask[..., None]).sum(1) / lengths[:, None].clamp(min=1)
            pooled[torch.tensor(group)] = self.proj_embedding(mean)
        return pooled + off, off


def char_map_with_padding(vocab: dict[str, int]) -> dict[int, tuple[int, ...]]:
    """``char_map`` plus the reference's padding subword (id ``len(vocab)``), spelled with the
    padding character."""
    chars, count = char_map(vocab)
    return {**chars, len(vocab): (count,)}
