"""The Qwen2 decoder on a paged KV cache: CosyVoice3's speech-token LM backbone (Qwen2-0.5B).

A Qwen2 block is a Llama block whose q, k and v projections carry biases while the output
projection does not (Llama's ``attention_bias`` switches all four together). So the decoder is
Llama's (``mstar.model.llama.modeling``: fused q/k/v and gate/up projections, tensor
parallelism, the fused kernels) with that attention swapped in. Parameter names are the
``Qwen2ForCausalLM`` checkpoint's under ``model.``.

CosyVoice never uses the text head (its own speech head reads the final hidden state), so the
backbone is built with tied embeddings whatever ``config.json`` says: no ``lm_head`` is held.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mstar.layers.linear import RowParallelLinear
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

__all__ = ["Qwen2Backbone", "qwen2_config"]


def qwen2_config(d: dict[str, Any]) -> LlamaConfig:
    """The Llama hyper-parameters of a Qwen2 ``config.json`` dict. Sliding-window attention
    (off in every released Qwen2 LM checkpoint of CosyVoice) is refused, naming the key."""
    if d.get("use_sliding_window", False):
        raise NotImplementedError("use_sliding_window: Qwen2 sliding-window attention is not supported")
    if d.get("model_type", "qwen2") != "qwen2":
        raise ValueError(f"model_type: expected 'qwen2', got {d.get('model_type')!r}")
    config = LlamaConfig.from_hf_dict(d)
    return replace(config, attention_bias=True, mlp_bias=False, tie_word_embeddings=True)


class Qwen2PagedAttention(LlamaAttention):
    """``LlamaAttention`` with biased q/k/v and an unbiased output projection."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(replace(config, attention_bias=True))
        assert config.head_dim is not None
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=False, block=config.head_dim)


class Qwen2PagedDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2PagedAttention


class Qwen2PagedModel(LlamaModel):
    layer_cls = Qwen2PagedDecoderLayer


class Qwen2Backbone(LlamaForCausalLM):
    """``LlamaForCausalLM`` with Qwen2's attention and no text head: ``forward`` returns the
    final-normed hidden states of the step's tokens (``inputs_embeds`` in place of ids)."""

    model_cls = Qwen2PagedModel

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(replace(config, tie_word_embeddings=True))
