"""Qwen3.5 / Qwen3.8: the hybrid gated-DeltaNet + gated-attention language model."""

from mstar.model.qwen3_5.config import Qwen3_5Config
from mstar.model.qwen3_5.modeling import HybridCaches, Qwen3_5ForCausalLM

__all__ = ["HybridCaches", "Qwen3_5Config", "Qwen3_5ForCausalLM"]
