"""Qwen3-Omni's thinker text decoder on a paged KV cache.

A thinker layer is a Qwen3 layer (q/k RMSNorm per head before RoPE; ``mstar.model.qwen3.causal``
on Llama's paged decoder) whose MLP is a sparse MoE (``mstar.layers.moe.SparseMoE``; the layers
in ``mlp_only_layers`` keep a dense SwiGLU), with multimodal RoPE: three positions per token
(temporal, height, width), the frequencies interleaved over the three axes
(``MRotaryEmbedding``). Text tokens have all three equal, so a text-only prompt is ordinary
RoPE over ``meta.positions``; audio and vision tokens pass their ``[3, T]`` positions.

Images also reach past the embeddings (deepstack): ``Deepstack`` names the step's image-token
rows and, per decoder layer from the first, the vision features added to those rows' hidden
states after that layer.

Parameter names are the ``thinker.model`` / ``thinker.lm_head`` keys of the released
checkpoint, less the ``thinker.`` prefix, except for the fused projections (``qkv_proj``,
``gate_up_proj``) and the stacked experts (``mlp.experts.gate_up.weight``,
``mlp.experts.down.weight``), which ``load_weights`` fills from the per-expert keys.

``use_fused_kernels(True)`` runs the sparse layers' experts as the grouped-GEMM Triton kernels
(``mstar.layers.triton_moe``: CUDA, or the CPU under Triton's interpreter); everything else
stays eager, since the Llama decoder's fused element-wise and GEMV paths assume a dense MLP.
``use_compile`` is not wired for the MoE yet and refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.linear import ParallelLMHead, VocabParallelEmbedding
from mstar.layers.mlp import SwiGLU
from mstar.layers.moe import SparseMoE, moe_kernel, use_moe_kernel
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import MRotaryEmbedding
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaForCausalLM, LlamaModel
from mstar.model.qwen3.causal import Qwen3PagedAttention, Qwen3PagedDecoderLayer
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig


def llama_config(config: Qwen3OmniTextConfig) -> LlamaConfig:
    """The Llama hyper-parameters the attention, norms and head are built from."""
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                       rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       max_position_embeddings=config.max_position_embeddings,
                       tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
                       bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)


class ThinkerDecoderLayer(Qwen3PagedDecoderLayer):
    """A Qwen3 block whose MLP is a ``SparseMoE`` (or, in ``mlp_only_layers``, a SwiGLU); the
    talker's blocks add the MoE's shared expert (``shared_expert_intermediate_size``)."""

    def __init__(self, config: Qwen3OmniTextConfig, layer: int) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer's own MLP would be the wrong one
        base = llama_config(config)
        self.self_attn = Qwen3PagedAttention(base)
        if config.is_sparse(layer):
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob,
                                 shared_inner=config.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, fused=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Deepstack:
    """Vision features for a step's image tokens beyond their input embeddings."""

    rows: torch.Tensor  # [T] bool: the step's tokens that are image tokens
    layers: list[torch.Tensor]  # i: [rows.sum(), hidden], added after decoder layer i

    def __post_init__(self) -> None:
        count = int(self.rows.sum())
        bad = [tuple(f.shape) for f in self.layers if f.shape[0] != count]
        if bad:
            raise ValueError(f"deepstack features {bad} for {count} image rows")


class ThinkerTextModel(LlamaModel):
    """Embeddings, thinker layers and final norm (the ``thinker.model.`` keys)."""

    def __init__(self, config: Qwen3OmniTextConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ThinkerDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                inputs_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                deepstack: Deepstack | None = None) -> torch.Tensor:
        return self.forward_keeping(input_ids, meta, kv_caches, inputs_embeds, positions, deepstack)[0]

    def forward_keeping(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata,
                        kv_caches: list[torch.Tensor], inputs_embeds: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None, deepstack: Deepstack | None = None,
                        layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s final-normed states and, for ``layer`` ``k``, the hidden states
        transformers reports as ``hidden_states[k]``: the input embeddings for 0, the output of
        decoder layer ``k - 1`` (un-normed, deepstack added) below the last, the final-normed
        states for ``num_hidden_layers`` (the talker's ``accept_hidden_layer`` input)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if layer is not None and not 0 <= layer <= len(self.layers):
            raise ValueError(f"layer {layer} outside 0 .. {len(self.layers)}")
        kept = x if layer == 0 else None
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        if deepstack is not None and len(deepstack.layers) > len(self.layers):
            raise ValueError(f"{len(deepstack.layers)} deepstack layers for {len(self.layers)} decoder layers")
        cos_sin = self.rotary_emb.cos_sin(meta.positions if positions is None else positions, x.dtype)
        extra = deepstack.layers if deepstack is not None else []
        residual = None
        for i, (block, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = block(x, residual, cos_sin, meta, kv_cache)
            if i < len(extra):  # the layer's output is x + residual: add to the un-summed part
                x = x.index_add(0, deepstack.rows.nonzero().squeeze(1), extra[i].to(x.dtype))
            if layer == i + 1 < len(self.layers):
                kept = x if residual is None else x + residual
        final = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return final, final if layer == len(self.layers) else kept


class Qwen3OmniThinkerForCausalLM(LlamaForCausalLM):
    """The thinker's text decoder with its head, one paged step per ``forward``."""

    def __init__(self, config: Qwen3OmniTextConfig) -> None:
        nn.Module.__init__(self)
        self.text_config = config
        self.config = llama_config(config)
        self.model = ThinkerTextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                inputs_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                deepstack: Deepstack | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` new tokens.

        ``positions`` (``[3, T]`` MRoPE positions) defaults to ``meta.positions`` on all three
        axes (text); ``inputs_embeds [T, hidden]`` replaces the embedding lookup when given;
        ``deepstack`` adds the image rows' vision features after the first layers."""
        return self.model(input_ids, meta, kv_caches, inputs_embeds, positions, deepstack)

    def forward_keeping(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata,
                        kv_caches: list[torch.Tensor], layer: int,
                        inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` (text rows) and the hidden states of ``layer`` (``ThinkerTextModel.forward_keeping``)."""
        final, kept = self.model.forward_keeping(input_ids, meta, kv_caches, inputs_embeds, layer=layer)
        return final, kept

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Run the MoE experts as the Triton kernels (``triton_fused_moe``) or back as the
        torch loop; attention, norms and the dense MLPs stay eager either way."""
        use_moe_kernel(self, "triton" if enabled else "loop")

    @property
    def fused_kernels(self) -> bool:
        """Whether ``use_fused_kernels`` is on."""
        return moe_kernel(self) == "triton"

    def use_compile(self, backend: str | None = "inductor") -> None:
        if backend is not None:
            raise NotImplementedError("torch.compile is not wired for the Qwen3-Omni MoE layers yet")
