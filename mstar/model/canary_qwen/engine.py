"""Canary-Qwen's engines: the speech side (a stateless node: encoder, adapter, projection,
every clip of a plan in one padded forward) and the LLM, the autoregressive engine over paged
KV whose prefill splices each request's audio embeddings over its prompt's locator positions
(``AudioPromptForward``).

A prompt holds one locator token per audio embedding (the request side expands NeMo's single
tag to the clip's count), so positions, pages and the token budget count the real sequence.
The K/V of those positions depend on the audio, not the token ids: no prefix caching, and no
preemption (a recomputed prefill would need the audio again): requests hold their peak pages
from admission (``decode_request(upfront=True)``). Decode steps are plain Qwen3 steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.engine.forward import Forward
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.canary_qwen.modeling import CanaryQwenModel, splice


def speech_fn(model: CanaryQwenModel):
    """The encoder node: log-mels ``mel`` ``[T, mel]`` in, ``audio_features`` ``[T', llm_hidden]`` out."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.proj.weight
        mels = [item.inputs["mel"].to(weight.device, weight.dtype) for item in items]
        lengths = torch.tensor([m.shape[0] for m in mels], dtype=torch.int64, device=weight.device)
        embeds, lengths = model.encode(nn.utils.rnn.pad_sequence(mels, batch_first=True), lengths)
        return [{"audio_features": e[:n]} for e, n in zip(embeds, lengths.tolist())]

    return run


class AudioPromptForward(Forward):
    kv_from_tokens = False
    preemptible = False

    def __init__(self, model: CanaryQwenModel, locator_id: int) -> None:
        super().__init__(model)
        self.graph_rows = None  # eager decode steps only
        self.locator_id = locator_id

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        audio = [item.inputs.get("audio_features") if item.op == "prefill" else None for item in items]
        if all(a is None for a in audio):
            return {"embeds": None}
        bounds = meta.query_start_loc.tolist()
        prefill = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, clip in enumerate(audio):
            if clip is not None:
                prefill[bounds[row]:bounds[row + 1]] = True
        embeds = self.model.embed_input_ids(input_ids.masked_fill(prefill & (input_ids == self.locator_id), 0))
        for row, clip in enumerate(audio):
            lo, hi = bounds[row], bounds[row + 1]
            if clip is not None:
                embeds[lo:hi] = splice(embeds[lo:hi], input_ids[lo:hi], self.locator_id, clip.to(embeds.device))
        return {"embeds": embeds}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        return self.model(input_ids, meta, kv_caches, inputs_embeds=inputs["embeds"])


def canary_qwen_engines(model: CanaryQwenModel, nodes: set[str], *, locator_id: int, num_pages: int,
                        page_size: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                        attention_backend: str = "torch", fused_kernels: bool = False) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    model.use_fused_kernels(fused_kernels)
    if "encoder" in nodes:
        engines["encoder"] = StatelessEngine(speech_fn(model))
    if "decoder" in nodes:
        engines["decoder"] = AutoregressiveEngine(
            model, KVLayout(*model.cache_shape()), num_pages=num_pages, page_size=page_size,
            max_seq_len=max_seq_len, device=device, dtype=dtype, forward=AudioPromptForward(model, locator_id),
            attention_backend=attention_backend)
    return engines
