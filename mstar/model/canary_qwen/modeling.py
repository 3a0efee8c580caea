"""Canary-Qwen: the FastConformer encoder, a two-block conformer modality adapter and a
linear projection turn a clip's log-mels into LLM input embeddings (one per 80 ms), which
replace the audio locator token of the prompt; Qwen3-1.7B (LoRA merged at load) decodes the
transcript over the paged KV cache.

``encode`` is the speech side, batched across clips; the LLM is ``Qwen3ForCausalLM`` (its
``forward`` takes ``inputs_embeds`` for the spliced prefill). ``splice`` writes a prompt's
audio rows over its locator positions. Parameter names: ``encoder.*`` and ``adapter.*`` are
transformers' ``ParakeetEncoder``'s, ``proj.*`` NeMo's ``perception.proj``, ``llm.*``
``Qwen3ForCausalLM``'s (``checkpoint.py`` maps the released NeMo names onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.audio_prompt import splice
from mstar.model.canary_qwen.config import CanaryQwenConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder
from mstar.model.qwen3.causal import Qwen3ForCausalLM


class CanaryQwenModel(nn.Module):
    def __init__(self, config: CanaryQwenConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = FastConformerEncoder(config.encoder)
        self.adapter = FastConformerEncoder(config.adapter)
        self.proj = nn.Linear(config.adapter.hidden_size, config.llm.hidden_size)
        self.llm = Qwen3ForCausalLM(config.llm)

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LLM input embeddings ``[B, T', llm_hidden]`` and their counts, of log-mels ``[B, T, mel]``."""
        frames, lengths = self.encoder(mel, lengths)
        frames, lengths = self.adapter(frames, lengths)
        return self.proj(frames), lengths

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


__all__ = ["CanaryQwenModel", "splice"]
