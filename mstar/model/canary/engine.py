"""Canary's engines: the batched encoder (a stateless node) and the decoder, the
autoregressive engine over paged self-attention KV with a forward that cross-attends to each
request's clip.

A request's cross-attention keys and values are projected from its encoder frames at its
prefill (all layers, once) and kept until ``release``, however the request ends. They depend
on the audio, not on the token ids: no prefix caching. A preempted sequence recomputes its
tokens over its kept K/V."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.engine.forward import Forward
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.canary.modeling import CanaryForConditionalGeneration, CrossBatch, CrossKV


def encoder_fn(model: CanaryForConditionalGeneration):
    """The encoder node: every clip of the plan in one padded forward; each gets back its own
    frames (``audio_features`` ``[T_i, hidden]``)."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.proj_out.bias
        mels = [item.inputs["mel"].to(weight.device, weight.dtype) for item in items]
        lengths = torch.tensor([m.shape[0] for m in mels], dtype=torch.int64, device=weight.device)
        frames, lengths = model.encode(nn.utils.rnn.pad_sequence(mels, batch_first=True), lengths)
        return [{"audio_features": f[:n]} for f, n in zip(frames, lengths.tolist())]

    return run


class CrossAttentionForward(Forward):
    kv_from_tokens = False  # past the first layer, a position's K/V depend on the audio

    def __init__(self, model: CanaryForConditionalGeneration, device: torch.device) -> None:
        super().__init__(model)
        self.graph_rows = None  # eager decode steps only
        self.device = device
        self.clips: dict[str, list[CrossKV]] = {}

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        for item in items:
            if item.request_id not in self.clips:
                features = item.inputs.get("audio_features")
                if features is None:
                    raise ValueError(f"request {item.request_id}: its first step has no audio_features")
                weight = self.model.proj_out.bias
                self.clips[item.request_id] = self.model.cross_kv(features.to(self.device, weight.dtype))
        return {"cross": CrossBatch.build([self.clips[item.request_id] for item in items],
                                          counts if counts is not None else [1] * len(items))}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        return self.model(input_ids, meta, kv_caches, inputs["cross"])

    def release(self, request_id: str) -> None:
        self.clips.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"cross_kv_held": len(self.clips)}


def canary_engines(model: CanaryForConditionalGeneration, nodes: set[str], *, num_pages: int, page_size: int,
                   device: torch.device, dtype: torch.dtype) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    if "encoder" in nodes:
        engines["encoder"] = StatelessEngine(encoder_fn(model))
    if "decoder" in nodes:
        engines["decoder"] = AutoregressiveEngine(
            model, KVLayout(*model.kv_layout()), num_pages=num_pages, page_size=page_size,
            max_seq_len=model.config.decoder.max_position_embeddings, device=device, dtype=dtype,
            forward=CrossAttentionForward(model, device))
    return engines
