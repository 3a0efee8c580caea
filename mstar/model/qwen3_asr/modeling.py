"""Qwen3-ASR: the AuT encoder and projector turn each clip's log-mels into LLM input
embeddings (one per ~80 ms), which replace the prompt's ``<|audio_pad|>`` tokens; a dense
Qwen3 decoder (``mstar.model.qwen3.causal``, paged KV) writes ``language <Name><asr_text>``
and the transcript.

Parameter names: ``audio_tower.*`` and ``multi_modal_projector.*`` are transformers'
``Qwen3ASRModel``'s, ``llm.*`` a ``Qwen3ForCausalLM``'s (``checkpoint.py`` maps both released
layouts onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.qwen3.causal import Qwen3ForCausalLM
from mstar.model.qwen3_asr.config import Qwen3ASRConfig
from mstar.model.qwen3_asr.encoder import AudioProjector, AuTEncoder


class Qwen3ASRModel(nn.Module):
    def __init__(self, config: Qwen3ASRConfig) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = AuTEncoder(config.audio)
        self.multi_modal_projector = AudioProjector(config.audio)
        self.llm = Qwen3ForCausalLM(config.llm)

    def encode(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """LLM input embeddings ``[positions(T_i), hidden]`` of each clip's log-mels ``[T_i, mel]``,
        every clip in one forward."""
        states = self.audio_tower(mels)
        counts = [s.shape[0] for s in states]
        return list(self.multi_modal_projector(torch.cat(states)).split(counts))

    def forward(self, input_ids, meta, kv_caches, inputs_embeds=None) -> torch.Tensor:
        return self.llm(input_ids, meta, kv_caches, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llm.embed_input_ids(input_ids)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        self.llm.use_fused_kernels(enabled)

    def cache_shape(self) -> tuple[int, int, int]:
        return self.llm.cache_shape()


__all__ = ["Qwen3ASRModel"]
