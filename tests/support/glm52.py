"""A tiny GLM-5.2 (transformers' ``GlmMoeDsaForCausalLM``) for parity and checkpoint tests,
and its weights in the released per-expert key layout."""

from __future__ import annotations

import math

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=2,
    topk_group=1, num_experts_per_tok=3, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=40,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, index_topk=6, index_head_dim=16,
    index_n_heads=16, first_k_dense_replace=1, indexer_types=["full", "shared", "full"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=512,
    tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
)


def tiny_reference(seed: int = 0, **overrides) -> GlmMoeDsaForCausalLM:
    """The reference in float32 on the CPU (eager attention), weights random at a scale that
    keeps every path's signal alive: norms near one, projections ~1/sqrt(fan-in), a router
    score-correction bias that matters. 16 indexer heads: with few, a key every head scores
    below zero scores exactly 0 (the ReLU), and the top-k among such ties is arbitrary."""
    config = GlmMoeDsaConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("k_norm.bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return model


def released_tensors(model: GlmMoeDsaForCausalLM) -> dict[str, torch.Tensor]:
    """The reference's weights under the released checkpoint's keys: each expert apart
    (``experts.{i}.{gate,up,down}_proj.weight``) where transformers stacks them."""
    out = {}
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for i, expert in enumerate(tensor):
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}{i}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{i}.up_proj.weight"] = up.clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for i, expert in enumerate(tensor):
                out[f"{prefix}{i}.down_proj.weight"] = expert.clone()
        else:
            out[name] = tensor.clone()
    return out
