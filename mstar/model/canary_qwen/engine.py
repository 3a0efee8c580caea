"""Canary-Qwen's engines: the speech side (a stateless node: encoder, adapter, projection,
every clip of a plan in one padded forward) and the LLM, the autoregressive engine over paged
KV whose prefill splices each request's audio embeddings over its prompt's locator positions
(``AudioPromptForward``).

The prompt holds one locator token per audio embedding (the request side expands NeMo's single
tag to the clip's count); ``mstar.model.audio_prompt`` says what that means for pages and
preemption. Decode steps are plain Qwen3 steps.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.model.audio_prompt import AudioPromptForward
from mstar.model.canary_qwen.modeling import CanaryQwenModel


def speech_fn(model: CanaryQwenModel):
    """The encoder node: log-mels ``mel`` ``[T, mel]`` in, ``audio_features`` ``[T', llm_hidden]`` out."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.proj.weight
        mels = [item.inputs["mel"].to(weight.device, weight.dtype) for item in items]
        lengths = torch.tensor([m.shape[0] for m in mels], dtype=torch.int64, device=weight.device)
        embeds, lengths = model.encode(nn.utils.rnn.pad_sequence(mels, batch_first=True), lengths)
        return [{"audio_features": e[:n]} for e, n in zip(embeds, lengths.tolist())]

    return run


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
