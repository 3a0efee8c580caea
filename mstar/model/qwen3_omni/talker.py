"""Qwen3-Omni's talker (thinker states to codec tokens) and its code predictor.

The codec has ``Q = num_code_groups`` codebooks (16 released). One talker step makes one codec
frame:

* the **talker** decoder (``Qwen3OmniTalker``: the thinker's layers, ``ThinkerDecoderLayer`` on
  the paged KV cache with interleaved MRoPE, each MoE with a gated shared expert) takes one
  input embedding per token and its ``codec_head`` gives the logits of codebook 0;
* the **code predictor** (``Qwen3OmniCodePredictor``: a small dense Qwen3 decoder) then runs
  ``Q - 1`` inner steps for that frame alone: its prompt is two rows, the talker's final-normed
  hidden state and codebook 0's embedding (the talker's ``codec_embedding``); step ``j`` reads
  code ``j`` with head ``lm_head[j - 1]`` and feeds its embedding (``codec_embedding[j - 1]``)
  to step ``j + 1``. Its KV lives only for the frame: a small paged cache of its own, one page
  of ``Q`` slots per request, made per call and dropped after it.
* the talker's next input is the sum of the frame's ``Q`` code embeddings (``CodecFrame.embeds``)
  plus the text side (the thinker's next token through ``text_projection``, or the projected
  ``tts_pad`` once the text is used up): assembling that, and the prompt, is the caller's.

``text_projection`` and ``hidden_projection`` (two-layer SiLU MLPs) bring thinker embeddings
and thinker hidden states (``accept_hidden_layer``) into the talker's width.

Parameter names are the released ``talker.`` keys less that prefix, except for the fused
projections and stacked experts (see ``mstar.model.qwen3_omni.modeling``), which
``load_talker`` fills from the per-tensor keys.

``Qwen3OmniTalker.use_fused_kernels(True)`` runs the talker decoder's routed experts as the
grouped-GEMM Triton kernels (``mstar.layers.triton_moe``); its shared experts, attention and
the code predictor stay eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import ParallelLMHead, VocabParallelEmbedding
from mstar.layers.moe import moe_kernel, use_moe_kernel
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from mstar.model.hf_config import config_kwargs, normalize_rope_scaling
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaModel
from mstar.model.qwen3.causal import Qwen3PagedDecoderLayer
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.modeling import ThinkerDecoderLayer, ThinkerTextModel

# transformers' ``Qwen3OmniMoeTalkerTextConfig`` defaults where they differ from the thinker's,
# so that a talker ``text_config`` omitting a key means the same here as there
TALKER_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=2, moe_intermediate_size=384, num_experts_per_tok=8, num_experts=128,
    norm_topk_prob=False, rope_theta=10000.0)


def talker_text_config(d: dict[str, Any]) -> Qwen3OmniTextConfig:
    """The talker decoder's hyper-parameters from its ``text_config`` dict (``num_local_experts``,
    the name transformers writes, read as ``num_experts``)."""
    d = dict(d)
    if "num_local_experts" in d and "num_experts" not in d:
        d["num_experts"] = d["num_local_experts"]
    return Qwen3OmniTextConfig.from_hf_dict({**TALKER_TEXT_DEFAULTS, **d})


@dataclass
class Qwen3OmniCodePredictorConfig:
    """The code predictor's dense decoder; names and defaults follow transformers'
    ``Qwen3OmniMoeTalkerCodePredictorConfig``."""

    vocab_size: int = 2048  # one codebook's entries
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None
    num_code_groups: int = 32

    def __post_init__(self) -> None:
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None:
            raise NotImplementedError(f"code predictor rope_type {self.rope_scaling['rope_type']!r} is not supported")
        if any(kind != "full_attention" for kind in self.layer_types or []):
            raise NotImplementedError(f"code predictor layer_types {self.layer_types}: only full_attention")
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups {self.num_code_groups}: the predictor needs at least 2")

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings,
                           attention_bias=self.attention_bias, hidden_act=self.hidden_act)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniCodePredictorConfig:
        """From a ``code_predictor_config`` dict (unknown keys ignored)."""
        return cls(**config_kwargs(cls, d, nullable={"layer_types"}))


@dataclass
class Qwen3OmniTalkerConfig:
    """The talker: its decoder (``text``), the code predictor and the codec's special ids."""

    text: Qwen3OmniTextConfig
    code_predictor: Qwen3OmniCodePredictorConfig
    num_code_groups: int = 32
    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 18  # the thinker layer whose output ``hidden_projection`` takes
    codec_eos_token_id: int = 4198
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    speaker_id: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        text, predictor = self.text, self.code_predictor
        if self.num_code_groups != predictor.num_code_groups:
            raise ValueError(f"talker num_code_groups {self.num_code_groups} != code_predictor_config."
                             f"num_code_groups {predictor.num_code_groups}")
        if predictor.hidden_size != text.hidden_size:  # the talker's hidden state is the predictor's first row
            raise ValueError(f"code_predictor_config.hidden_size {predictor.hidden_size} != talker "
                             f"text_config.hidden_size {text.hidden_size}")
        if not all(text.is_sparse(i) for i in range(text.num_hidden_layers)):
            raise NotImplementedError("the talker's layers are all sparse: text_config.mlp_only_layers must be "
                                      "empty and decoder_sparse_step 1")
        if text.shared_expert_intermediate_size <= 0:
            raise ValueError("text_config.shared_expert_intermediate_size must be set (the talker's shared expert)")
        if text.tie_word_embeddings:
            raise NotImplementedError("a codec_head tied to codec_embedding is not supported")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniTalkerConfig:
        """From a whole Omni ``config.json`` dict (``talker_config``) or a talker config dict."""
        d = d.get("talker_config", d)
        names = {"num_code_groups", "thinker_hidden_size", "accept_hidden_layer", "codec_eos_token_id",
                 "codec_pad_id", "codec_bos_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id",
                 "speaker_id"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        return cls(text=talker_text_config(d.get("text_config") or {}),
                   code_predictor=Qwen3OmniCodePredictorConfig.from_hf_dict(d.get("code_predictor_config") or {}),
                   **kwargs)


class ThinkerProjection(nn.Module):
    """``linear_fc2(silu(linear_fc1(x)))`` (both with bias): thinker vectors into the talker's
    width (``text_projection``, ``hidden_projection``)."""

    def __init__(self, in_dim: int, inner: int, out_dim: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_dim, inner)
        self.linear_fc2 = nn.Linear(inner, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(ThinkerTextModel):
    """The talker's decoder (the ``talker.model.`` keys): thinker layers with shared experts, the
    final norm, and the codec embedding its inputs are built from (no text embedding)."""

    def __init__(self, config: Qwen3OmniTextConfig) -> None:
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(ThinkerDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)
        self.codec_embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size)

    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(None, meta, kv_caches, inputs_embeds, positions)


Sampler = Callable[[torch.Tensor, int], torch.Tensor]
"""``sampler(logits [B, vocab], group) -> codes [B]``: picks codebook ``group``'s code (1 .. Q - 1)
of each request from the code predictor's logits; ``None`` is greedy (argmax)."""


@dataclass
class CodecFrame:
    """One talker step's codec frame for ``B`` requests."""

    codes: torch.Tensor  # [B, Q]: codebook 0 (the talker's) then 1 .. Q - 1 (the code predictor's)
    embeds: torch.Tensor  # [B, hidden]: the sum of the Q codes' embeddings (the codec part of the next input)


def frame_step_metadata(batch: int, start: int, count: int, page_size: int,
                        device: torch.device) -> PagedAttentionMetadata:
    """Metadata of a code-predictor step: ``count`` tokens per request at positions ``start ..``,
    request ``b`` on page ``b`` of its own cache."""
    offsets = torch.arange(start, start + count, device=device)
    rows = torch.arange(batch, device=device)
    return PagedAttentionMetadata(
        positions=offsets.repeat(batch), slot_mapping=(rows[:, None] * page_size + offsets[None]).reshape(-1),
        query_start_loc=torch.arange(batch + 1, device=device) * count,
        seq_lens=torch.full((batch,), start + count, device=device), page_table=rows[:, None], page_size=page_size,
        host_query_start_loc=tuple(range(0, (batch + 1) * count, count)), host_seq_lens=(start + count,) * batch)


class CodePredictorModel(LlamaModel):
    """The code predictor's decoder (``talker.code_predictor.model.``): Qwen3 layers (q/k norms,
    plain RoPE), the final norm and one embedding per codebook 1 .. Q - 1."""

    def __init__(self, config: Qwen3OmniCodePredictorConfig) -> None:
        nn.Module.__init__(self)
        base = config.llama_config()
        self.layers = nn.ModuleList(Qwen3PagedDecoderLayer(base) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.codec_embedding = nn.ModuleList(nn.Embedding(config.vocab_size, config.hidden_size)
                                             for _ in range(config.num_code_groups - 1))


class Qwen3OmniCodePredictor(nn.Module):
    """Codebooks 1 .. Q - 1 of a frame from the talker's hidden state and codebook 0."""

    def __init__(self, config: Qwen3OmniCodePredictorConfig) -> None:
        super().__init__()
        self.config = config
        self.model = CodePredictorModel(config)
        self.lm_head = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                                     for _ in range(config.num_code_groups - 1))

    def forward(self, hidden: torch.Tensor, code0: torch.Tensor, code0_embeds: torch.Tensor,
                sampler: Sampler | None = None) -> CodecFrame:
        """The frame of ``B`` requests: ``hidden [B, H]`` (the talker's final-normed state at the
        token that gave codebook 0), ``code0 [B]`` and its talker embedding ``code0_embeds [B, H]``.
        The ``Q - 1`` inner steps run all requests together on a fresh cache."""
        batch, groups = hidden.shape[0], self.config.num_code_groups
        attn = self.model.layers[0].self_attn  # a tensor-parallel rank caches the KV heads it holds
        layers, heads, head_dim = len(self.model.layers), attn.num_kv_heads, attn.head_dim
        caches = allocate_kv_cache(layers, batch, groups, heads, head_dim, hidden.dtype, hidden.device)
        prompt = torch.stack((hidden, code0_embeds), dim=1).reshape(2 * batch, -1)
        meta = frame_step_metadata(batch, 0, 2, groups, hidden.device)
        last = self.model(None, meta, caches, prompt).view(batch, 2, -1)[:, 1]
        codes, embeds = [code0], [code0_embeds]
        for group in range(1, groups):
            logits = self.lm_head[group - 1](last)
            code = logits.argmax(dim=-1) if sampler is None else sampler(logits, group)
            codes.append(code)
            embeds.append(self.model.codec_embedding[group - 1](code))
            if group < groups - 1:  # the last code is never fed back
                meta = frame_step_metadata(batch, group + 1, 1, groups, hidden.device)
                last = self.model(None, meta, caches, embeds[-1])
        return CodecFrame(torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(dim=1))


class Qwen3OmniTalker(nn.Module):
    """The talker with its projections, codec head and code predictor (the ``talker.`` keys)."""

    def __init__(self, config: Qwen3OmniTalkerConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text
        self.model = TalkerModel(text)
        self.text_projection = ThinkerProjection(config.thinker_hidden_size, text.intermediate_size,
                                                 text.hidden_size)
        self.hidden_projection = ThinkerProjection(config.thinker_hidden_size, text.intermediate_size,
                                                   text.hidden_size)
        self.codec_head = ParallelLMHead(text.hidden_size, text.vocab_size)
        self.code_predictor = Qwen3OmniCodePredictor(config.code_predictor)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniTalker:
        return cls(Qwen3OmniTalkerConfig.from_hf_dict(d))

    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` input embeddings;
        ``positions [3, T]`` (MRoPE) default to ``meta.positions`` on all three axes."""
        return self.model(inputs_embeds, meta, kv_caches, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits ``[N, vocab]`` (codes and the codec's special tokens)."""
        return self.codec_head(hidden)

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """The talker's embeddings of codec ids (codebook 0 and the special codec tokens)."""
        return self.model.codec_embedding(ids)

    def predict_frame(self, hidden: torch.Tensor, code0: torch.Tensor, sampler: Sampler | None = None) -> CodecFrame:
        """The whole frame (all ``Q`` codes and their embedding sum) after codebook 0 was drawn
        from ``compute_logits(hidden)``; ``hidden [B, H]``, ``code0 [B]``."""
        return self.code_predictor(hidden, code0, self.embed_codec(code0), sampler)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Run the talker decoder's MoE experts as the Triton kernels (``triton_fused_moe``)
        or back as the torch loop; the rest (shared experts, attention, the code predictor)
        stays eager either way."""
        use_moe_kernel(self, "triton" if enabled else "loop")

    @property
    def fused_kernels(self) -> bool:
        """Whether ``use_fused_kernels`` is on."""
        return moe_kernel(self) == "triton"

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the talker's paged KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim
