"""Small random models the engine tests share."""

from __future__ import annotations

import torch

GPU_LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
"""The GPU engine tests' Llama: two layers, 2 KV heads of 64 (``KVLayout(2, 2, 64)``)."""


def random_llama(device: torch.device | str, **dims):
    """Our Llama with seed-0 random weights on ``device``, eval mode; ``dims``: LlamaConfig
    fields (``GPU_LLAMA`` for the GPU engine tests)."""
    from mstar.model.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**dims)).eval()
