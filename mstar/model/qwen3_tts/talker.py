"""Qwen3-TTS's talker (text and codec embeddings to codec frames) and its code predictor.

The 12 Hz codec has ``Q = num_code_groups`` codebooks (16 released). One talker step makes one
frame:

* the **talker** is a dense Qwen3 decoder on the paged KV cache. Its config carries MRoPE
  sections, but every row of a speech prompt has one text position on all three axes, so the
  rotation is the plain RoPE of that position. ``codec_head`` gives codebook 0's logits (and
  the codec's special tokens).
* the **code predictor** (a small dense Qwen3 decoder) then runs ``Q - 1`` inner steps for that
  frame alone. Its prompt is two rows in the talker's width, the talker's final-normed hidden
  state and codebook 0's talker embedding; step ``j`` reads code ``j`` with ``lm_head[j - 1]``
  and feeds its embedding (``codec_embedding[j - 1]``, talker width) to step ``j + 1``. Every
  input passes ``small_to_mtp_projection`` first: a linear layer on the 1.7B checkpoints,
  whose predictor is narrower than the talker, the identity on the 0.6B ones. Its KV lives only
  for the frame (a small cache of its own, one page of ``Q`` slots per request).
* the talker's next input is the sum of the frame's ``Q`` code embeddings (``CodecFrame.embeds``)
  plus the text side: the next text row through ``text_projection``, or the projected
  ``tts_pad`` once the text is used up. Assembling that, and the prompt, is the caller's
  (``mstar.model.qwen3_tts.prompt``).

Parameter names are the released ``talker.`` keys less that prefix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import ParallelLMHead, VocabParallelEmbedding
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.rotary import RotaryEmbedding
from mstar.model.llama.modeling import LlamaModel
from mstar.model.qwen3.causal import Qwen3PagedDecoderLayer
from mstar.model.qwen3_omni.talker import CodecFrame, Sampler, frame_step_metadata
from mstar.model.qwen3_tts.config import DecoderDims, TalkerConfig

__all__ = ["CodecFrame", "Sampler", "Qwen3TTSTalker", "Qwen3TTSCodePredictor"]


class ResizeMLP(nn.Module):
    """``linear_fc2(silu(linear_fc1(x)))`` with biases: text embeddings into the talker's width
    (``text_projection``)."""

    def __init__(self, in_dim: int, inner: int, out_dim: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_dim, inner)
        self.linear_fc2 = nn.Linear(inner, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class DenseQwen3(LlamaModel):
    """Qwen3 layers (q/k norms, plain RoPE) and the final norm, fed input embeddings."""

    def __init__(self, dims: DecoderDims) -> None:
        nn.Module.__init__(self)
        base = dims.llama_config()
        self.layers = nn.ModuleList(Qwen3PagedDecoderLayer(base) for _ in range(dims.num_hidden_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(dims.head_dim, dims.rope_theta)


class TalkerModel(DenseQwen3):
    """The talker's decoder (``talker.model.``) with its codec and text embeddings."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config.text)
        self.codec_embedding = VocabParallelEmbedding(config.text.vocab_size, config.text.hidden_size)
        self.text_embedding = VocabParallelEmbedding(config.text_vocab_size, config.text_hidden_size)


class PredictorModel(DenseQwen3):
    """The code predictor's decoder (``talker.code_predictor.model.``): one embedding per
    codebook 1 .. Q - 1, in the talker's width."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config.predictor)
        self.codec_embedding = nn.ModuleList(nn.Embedding(config.predictor.vocab_size, config.text.hidden_size)
                                             for _ in range(config.num_code_groups - 1))


class Qwen3TTSCodePredictor(nn.Module):
    """Codebooks 1 .. Q - 1 of a frame from the talker's hidden state and codebook 0."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.groups = config.num_code_groups
        width, dims = config.text.hidden_size, config.predictor
        self.model = PredictorModel(config)
        self.lm_head = nn.ModuleList(nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
                                     for _ in range(self.groups - 1))
        self.small_to_mtp_projection = (nn.Linear(width, dims.hidden_size) if width != dims.hidden_size
                                        else nn.Identity())

    def forward(self, hidden: torch.Tensor, code0: torch.Tensor, code0_embeds: torch.Tensor,
                sampler: Sampler | None = None, logits_out: list[torch.Tensor] | None = None, *,
                metas: list[PagedAttentionMetadata] | None = None,
                caches: list[torch.Tensor] | None = None) -> CodecFrame:
        """The frame of ``B`` requests: ``hidden [B, H]`` (the talker's final-normed state at
        the row that gave codebook 0), ``code0 [B]`` and its talker embedding ``code0_embeds``.
        The ``Q - 1`` inner steps run all requests together on a fresh cache; ``logits_out``,
        if given, collects each step's logits ``[B, vocab]``. ``metas`` and ``caches``: the
        steps' metadata (``frame_step_metadata``'s, first the two-row prompt) and the frame
        cache (one page of ``Q`` slots a request), given by a caller that keeps them (the
        CUDA graphs, ``talker_step.FramePredictor``); made here otherwise."""
        batch, groups = hidden.shape[0], self.groups
        if caches is None:
            attn = self.model.layers[0].self_attn
            caches = allocate_kv_cache(len(self.model.layers), batch, groups, attn.num_kv_heads, attn.head_dim,
                                       hidden.dtype, hidden.device)
        prompt = self.small_to_mtp_projection(torch.stack((hidden, code0_embeds), dim=1).reshape(2 * batch, -1))
        meta = metas[0] if metas is not None else frame_step_metadata(batch, 0, 2, groups, hidden.device)
        last = self.model(None, meta, caches, prompt).view(batch, 2, -1)[:, 1]
        codes, embeds = [code0], [code0_embeds]
        for group in range(1, groups):
            logits = self.lm_head[group - 1](last)
            if logits_out is not None:
                logits_out.append(logits)
            code = logits.argmax(dim=-1) if sampler is None else sampler(logits, group)
            codes.append(code)
            embeds.append(self.model.codec_embedding[group - 1](code))
            if group < groups - 1:  # the last code is never fed back
                meta = (metas[group] if metas is not None else
                        frame_step_metadata(batch, group + 1, 1, groups, hidden.device))
                last = self.model(None, meta, caches, self.small_to_mtp_projection(embeds[-1]))
        return CodecFrame(torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(dim=1))


class Qwen3TTSTalker(nn.Module):
    """The talker with its text projection, codec head and code predictor (``talker.`` keys)."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text
        self.model = TalkerModel(config)
        self.text_projection = ResizeMLP(config.text_hidden_size, config.text_hidden_size, text.hidden_size)
        self.codec_head = ParallelLMHead(text.hidden_size, text.vocab_size)
        self.code_predictor = Qwen3TTSCodePredictor(config)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3TTSTalker:
        """From a whole ``config.json`` dict (``talker_config``) or the talker part."""
        return cls(TalkerConfig.from_hf_dict(d.get("talker_config", d)))

    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` input embeddings."""
        return self.model(None, meta, kv_caches, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits ``[N, vocab]`` (codes and the codec's special tokens)."""
        return self.codec_head(hidden)

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """The talker's embeddings of codec ids (codebook 0 and the special codec tokens)."""
        return self.model.codec_embedding(ids)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids through the text embedding and ``text_projection`` (talker width)."""
        return self.text_projection(self.model.text_embedding(ids))

    def predict_frame(self, hidden: torch.Tensor, code0: torch.Tensor, sampler: Sampler | None = None,
                      logits_out: list[torch.Tensor] | None = None) -> CodecFrame:
        """The whole frame (all ``Q`` codes and their embedding sum) after codebook 0 was drawn
        from ``compute_logits(hidden)``; ``hidden [B, H]``, ``code0 [B]``."""
        return self.code_predictor(hidden, code0, self.embed_codec(code0), sampler, logits_out)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the talker's paged KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim
