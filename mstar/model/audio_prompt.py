"""An LLM prefill whose prompt carries audio: the shared forward side of the speech-to-text
families that splice encoder rows into a decoder-only LLM's input embeddings (Canary-Qwen,
Qwen3-ASR).

A prompt holds one placeholder token per audio embedding (the request side expands it to the
clip's count), so positions, pages and the token budget count the real sequence. Each prefill
row's ``audio_features`` ``[n, hidden]`` replace, in order, the embeddings of its placeholder
tokens. The K/V of those positions depend on the audio, not the token ids: no prefix caching,
and no preemption (a recomputed prefill would need the audio again), so requests hold their
peak pages from admission (``decode_request(upfront=True)``). Decode steps are plain steps:
they take no inputs besides the ids, so they replay from the engine's decode graphs
(``cuda_graphs``) and may be launched ahead (``overlap_scheduling``).

The model needs ``embed_input_ids(ids)`` and ``forward(ids, meta, kv_caches, inputs_embeds)``.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.engine.base import EngineItem
from mstar.engine.forward import Forward
from mstar.layers.paged_kv import PagedAttentionMetadata


def splice(embeds: torch.Tensor, input_ids: torch.Tensor, placeholder_id: int, audio: torch.Tensor) -> torch.Tensor:
    """``embeds`` ``[T, hidden]`` with the rows at ``placeholder_id`` tokens replaced, in order,
    by ``audio`` ``[n, hidden]`` (there must be exactly ``n`` of them)."""
    positions = (input_ids == placeholder_id).nonzero().squeeze(-1)
    if positions.numel() != audio.shape[0]:
        raise ValueError(f"{positions.numel()} audio positions in the prompt but {audio.shape[0]} audio embeddings")
    return embeds.index_copy(0, positions, audio.to(embeds.dtype))


class AudioPromptForward(Forward):
    kv_from_tokens = False
    preemptible = False

    def __init__(self, model: Any, placeholder_id: int) -> None:
        super().__init__(model)
        self.placeholder_id = placeholder_id

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        if counts is None:  # one token a row: decodes, or the step launched ahead after a prefill
            return {}
        audio = [item.inputs.get("audio_features") if item.op == "prefill" else None for item in items]
        if all(a is None for a in audio):
            return {}
        bounds = meta.query_start_loc.tolist()
        prefill = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, clip in enumerate(audio):
            if clip is not None:
                prefill[bounds[row]:bounds[row + 1]] = True
        embeds = self.model.embed_input_ids(input_ids.masked_fill(prefill & (input_ids == self.placeholder_id), 0))
        for row, clip in enumerate(audio):
            lo, hi = bounds[row], bounds[row + 1]
            if clip is not None:
                embeds[lo:hi] = splice(embeds[lo:hi], input_ids[lo:hi], self.placeholder_id, clip.to(embeds.device))
        return {"embeds": embeds}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        return self.model(input_ids, meta, kv_caches, inputs_embeds=inputs.get("embeds"))


__all__ = ["AudioPromptForward", "splice"]
