"""Higgs Audio's engines: the speech side (a stateless node: every slice of every clip of a
plan through the tower and the projector, slices of one length in one forward) and the LLM,
the autoregressive engine over paged KV whose prefill splices each request's audio embeddings
over its prompt's ``<|AUDIO|>`` tokens (Canary-Qwen's ``AudioPromptForward``: the same
splice, the same reasons for no prefix caching and no preemption).
"""

from __future__ import annotations

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.model.audio_prompt import AudioPromptForward
from mstar.model.higgs_audio.modeling import HiggsAudioModel


def speech_fn(model: HiggsAudioModel):
    """The encoder node: ``mel`` ``[n_mels, T]`` (a clip's slices side by side, each slice's
    frames in the request's ``slice_frames``) in, ``audio_features`` ``[P, llm_hidden]`` out."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.audio_encoder_proj.linear1.weight
        slices, owners = [], []
        for i, item in enumerate(items):
            mel = item.inputs["mel"].to(weight.device, weight.dtype)
            parts = mel.split(list(item.params["slice_frames"]), dim=-1)
            slices.extend(parts)
            owners.extend([i] * len(parts))
        embeds = model.encode_slices(slices)
        out: list[list[torch.Tensor]] = [[] for _ in items]
        for i, e in zip(owners, embeds):
            out[i].append(e)
        return [{"audio_features": torch.cat(parts)} for parts in out]

    return run


def higgs_audio_engines(model: HiggsAudioModel, nodes: set[str], *, num_pages: int, page_size: int,
                        max_seq_len: int, device: torch.device, dtype: torch.dtype,
                        attention_backend: str = "torch", fused_kernels: bool = False) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    model.use_fused_kernels(fused_kernels)
    if "encoder" in nodes:
        engines["encoder"] = StatelessEngine(speech_fn(model))
    if "decoder" in nodes:
        engines["decoder"] = AutoregressiveEngine(
            model, KVLayout(*model.cache_shape()), num_pages=num_pages, page_size=page_size,
            max_seq_len=max_seq_len, device=device, dtype=dtype,
            forward=AudioPromptForward(model, model.config.audio_in_token_id), attention_backend=attention_backend)
    return engines
