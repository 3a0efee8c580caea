"""Llama-architecture decoders (SmolLM2, Orpheus, ...) on a paged KV cache."""

from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
