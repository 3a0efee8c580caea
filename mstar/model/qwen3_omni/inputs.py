"""How audio enters the thinker's token sequence.

A clip is a run ``<|audio_start|> <|audio_pad|> x n <|audio_end|>`` in the prompt, ``n`` the
encoder's token count for it (``audio.audio_token_count``); the thinker's embeddings of the
pad tokens are replaced, in order, by the encoder's output rows. Without images or video the
reference gives every token, audio included, the same position on all three MRoPE axes
(``0 .. L-1``), so an audio+text prompt runs on the paged metadata's 1-D positions.
"""

from __future__ import annotations

import torch


def audio_run(num_tokens: int, start_id: int, pad_id: int, end_id: int) -> list[int]:
    """The prompt token ids standing for one clip of ``num_tokens`` encoder tokens."""
    return [start_id, *([pad_id] * num_tokens), end_id]


def splice_features(embeds: torch.Tensor, input_ids: torch.Tensor, pad_id: int,
                    features: list[torch.Tensor]) -> torch.Tensor:
    """``embeds [T, hidden]`` with the rows of the ``pad_id`` tokens of ``input_ids [T]``
    replaced by ``features`` (concatenated in order); their counts must match."""
    rows = torch.cat(features) if features else embeds.new_zeros(0, embeds.shape[1])
    mask = input_ids == pad_id
    if int(mask.sum()) != rows.shape[0]:
        raise ValueError(f"{int(mask.sum())} audio placeholder tokens for {rows.shape[0]} audio feature rows")
    out = embeds.clone()
    out[mask] = rows.to(embeds.dtype)
    return out
