"""S2's prompt: a chat of three turns, the reference clip's codes inline.

As fish-speech builds it for generation (``generate_long`` over a ``Conversation``)::

    <|im_start|>system\\n convert the provided text to speech reference to the following:
    \\n\\nText:\\n <|speaker:0|>{reference text} \\n\\nSpeech:\\n {reference frames} <|im_end|>\\n
    <|im_start|>user\\n {text} <|im_end|>\\n
    <|im_start|>assistant\\n<|voice|>

(the system turn is just ``convert the provided text to speech`` without a reference).
Each piece is tokenized on its own, without added special tokens; a reference frame is the
token ``<|semantic:c0|>`` with the frame's codes beside it, a text token has zero codes.
``[tag]`` prosody markers are plain text and pass through untouched. The model answers with
frames and ends with ``<|im_end|>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

SPEAKER = re.compile(r"<\|speaker:\d+\|>")


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class Reference:
    text: str
    codes: torch.Tensor  # [N, frames]: the clip's codes (``CodecEncoder``)


def build_prompt(tokenizer: TextTokenizer, text: str, references: list[Reference], semantic_begin_id: int,
                 num_codebooks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [T], codes [T, N])`` of the prompt for ``text`` in the voice of ``references``."""
    pieces: list[str | torch.Tensor] = ["<|im_start|>system\n"]
    if references:
        texts = [r.text if SPEAKER.search(r.text) else f"<|speaker:{i}|>{r.text}" for i, r in enumerate(references)]
        pieces += ["convert the provided text to speech reference to the following:\n\nText:\n", "\n".join(texts),
                   "\n\nSpeech:\n", torch.cat([r.codes for r in references], dim=1)]
    else:
        pieces.append("convert the provided text to speech")
    pieces += ["<|im_end|>\n", "<|im_start|>user\n", text, "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
    tokens, codes = [], []
    for piece in pieces:
        if isinstance(piece, str):
            ids = torch.tensor(tokenizer.encode(piece, add_special_tokens=False), dtype=torch.int64)
            tokens.append(ids)
            codes.append(torch.zeros(len(ids), num_codebooks, dtype=torch.int64))
        else:
            if piece.shape[0] != num_codebooks:
                raise ValueError(f"reference codes have {piece.shape[0]} codebooks; the model has {num_codebooks}")
            tokens.append(piece[0].to(torch.int64) + semantic_begin_id)
            codes.append(piece.t().to(torch.int64))
    return torch.cat(tokens), torch.cat(codes)


def slow_token_mask(logits: torch.Tensor, semantic_begin_id: int, codebook_size: int, eos_id: int) -> torch.Tensor:
    """``logits [B, V]`` with every id but the semantic tokens and ``<|im_end|>`` at -inf: S2's
    constrained decoding of the slow token (fish-speech's ``semantic_logit_bias``)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[semantic_begin_id:semantic_begin_id + codebook_size] = True
    keep[eos_id] = True
    return logits.masked_fill(~keep, float("-inf"))


def slow_candidates(logits: torch.Tensor, semantic_begin_id: int, codebook_size: int,
                    eos_id: int) -> tuple[torch.Tensor, list[int]]:
    """The logits ``[B, codebook_size + 1]`` of the only ids the slow step may draw (the
    semantic tokens and ``<|im_end|>``, in id order) and those ids: what ``slow_token_mask``
    leaves, without the rest of the vocabulary (about 150k ids in the release), so a draw
    sorts and copies 4097 values a row, not the whole vocabulary."""
    semantic = logits[:, semantic_begin_id:semantic_begin_id + codebook_size]
    eos = logits[:, eos_id:eos_id + 1]
    ids = list(range(semantic_begin_id, semantic_begin_id + codebook_size))
    if eos_id < semantic_begin_id:
        return torch.cat((eos, semantic), dim=1), [eos_id, *ids]
    return torch.cat((semantic, eos), dim=1), [*ids, eos_id]
