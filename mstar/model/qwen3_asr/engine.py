"""Qwen3-ASR's engines: the audio side (a stateless node: AuT encoder and projector, every
clip of a plan in one forward, their attention windows batched) and the LLM, the
autoregressive engine over paged KV whose prefill splices each request's audio rows over its
prompt's ``<|audio_pad|>`` tokens (``mstar.model.audio_prompt``)."""

from __future__ import annotations

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.model.audio_prompt import AudioPromptForward
from mstar.model.qwen3_asr.modeling import Qwen3ASRModel


def audio_fn(model: Qwen3ASRModel):
    """The encoder node: log-mels ``mel`` ``[T, mel]`` in, ``audio_features`` ``[N, hidden]`` out."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.multi_modal_projector.linear_1.weight
        mels = [item.inputs["mel"].to(weight.device, weight.dtype) for item in items]
        return [{"audio_features": rows} for rows in model.encode(mels)]

    return run


def qwen3_asr_engines(model: Qwen3ASRModel, nodes: set[str], *, num_pages: int, page_size: int, max_seq_len: int,
                      device: torch.device, dtype: torch.dtype, attention_backend: str = "torch",
                      fused_kernels: bool = False, cuda_graphs: bool = False,
                      overlap_scheduling: bool = False) -> dict[str, Engine]:
    """The engines of ``nodes``. ``cuda_graphs``: the LLM's decode steps replay from graphs, every
    batch bucket captured now (on CUDA with the Triton attention kernels: the torch reference
    synchronises with the host; off CUDA the bucketed path runs eagerly)."""
    engines: dict[str, Engine] = {}
    model.use_fused_kernels(fused_kernels)
    if "encoder" in nodes:
        engines["encoder"] = StatelessEngine(audio_fn(model))
    if "decoder" in nodes:
        backend = "triton" if cuda_graphs and device.type == "cuda" else attention_backend
        decoder = AutoregressiveEngine(
            model, KVLayout(*model.cache_shape()), num_pages=num_pages, page_size=page_size,
            max_seq_len=max_seq_len, device=device, dtype=dtype,
            forward=AudioPromptForward(model, model.config.audio_token_id), attention_backend=backend,
            cuda_graphs=cuda_graphs, overlap_scheduling=overlap_scheduling)
        if decoder.graphs is not None:
            decoder.graphs.capture_all()
        engines["decoder"] = decoder
    return engines
