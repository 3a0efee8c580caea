"""Qwen3 dense decoders as causal LMs on a paged KV cache (Canary-Qwen's LLM).

A Qwen3 block is a Llama block whose queries and keys get a per-head RMSNorm (``q_norm``,
``k_norm``, over ``head_dim``) before RoPE; ``head_dim`` is its own setting (128 by default,
not ``hidden / heads``). So the decoder is Llama's (``mstar.model.llama.modeling``: fused
q/k/v and gate/up projections, tensor parallelism, the fused kernels) with that attention
swapped in; parameter names are the ``Qwen3ForCausalLM`` checkpoint's.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from mstar.layers.norm import RMSNorm
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from mstar.model.qwen3.config import Qwen3Config


def llama_config(config: Qwen3Config) -> LlamaConfig:
    """The Llama hyper-parameters of a Qwen3 decoder (its ``head_dim`` explicit)."""
    fields = asdict(config)
    for name in ("use_sliding_window", "pad_token_id"):
        fields.pop(name)
    return LlamaConfig(**fields)


class Qwen3PagedAttention(LlamaAttention):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # normed as rows of head_dim (the fused norm kernel takes 2-D input)
        return (self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape),
                self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape))


class Qwen3PagedDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3PagedAttention


class Qwen3PagedModel(LlamaModel):
    layer_cls = Qwen3PagedDecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with Qwen3's attention; built from a ``Qwen3Config``."""

    model_cls = Qwen3PagedModel

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(llama_config(config))
        self.qwen3_config = config


__all__ = ["Qwen3ForCausalLM", "llama_config"]
