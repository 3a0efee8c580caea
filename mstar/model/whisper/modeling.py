"""Whisper encoder-decoder: a batched audio encoder and a decoder on a paged KV cache.

Parameter names are exactly the Hugging Face checkpoint keys, so a ``model.safetensors``
state dict loads with ``strict=True``. The output projection is tied to
``model.decoder.embed_tokens.weight`` (checkpoints store no ``proj_out.weight``); the embedding
is the project's ``VocabParallelEmbedding`` (on one rank exactly ``nn.Embedding``) so that its
``logits`` take a quantised copy of the rows (``model_kwargs.quantization``, applied from
outside by ``mstar.model.quantize``).

Serving splits a request's work in three: ``encode`` the 30 s log-mel once (batched across
requests), write its per-layer cross-attention keys/values once into a fixed-shape slot with
``write_cross_kv``, then run ``decode`` steps whose self-attention lives in paged caches and
whose cross-attention is one batched attention over the step's slots (``cross_kv.py``). As in
Hugging Face, queries are scaled before the attention product.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.linear import VocabParallelEmbedding
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.whisper.config import WhisperConfig
from mstar.model.whisper.cross_kv import CrossAttentionBatch, cross_attention

CrossKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [S, H, Dh] each

DECODE_GEMV_ROWS = 4
"""With ``fused_kernels``, steps of at most this many rows take ``forward_gemv`` (every
projection a Triton GEMV with its LayerNorm, GELU and KV-cache write folded in, the
attention's split combines in its kernel: 8 kernels a layer against ``forward_fused``'s 14
to 16, counted on the CPU, ``tests/model/test_whisper_fused.py``). On an H100 (2026-12-07,
``benchmarks/check_whisper_step.py``) it was 1-3% faster a step than ``forward_fused`` at 1-4
rows, and 5.7% once o and fc2 took configs swept at Whisper's widths (``_TUNED`` in
``mstar.layers.triton_gemv``; docs/benchmarks.md, S4): each kernel is latency-bound there. The norm
prologue is re-derived by every program, a cost that grows with the rows (at Llama-8B's 4096
features it lost to a separate norm kernel from 4 rows; Whisper large-v3 has 1280)."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class WhisperAttention(nn.Module):
    """The four projections of a Whisper attention block (``k_proj`` has no bias)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def fuse_qkv(self) -> None:
        """Concatenate the q, k and v projections into one ``[3 d, d]`` weight and ``[3 d]`` bias
        (k's slot zero) for ``qkv``; the three parameters become views of them, so loading
        weights afterwards still fills both."""
        if hasattr(self, "qkv_weight"):
            return
        d = self.q_proj.weight.shape[0]
        with torch.no_grad():
            weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            bias = torch.cat([self.q_proj.bias, torch.zeros_like(self.q_proj.bias), self.v_proj.bias])
        for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            proj.weight.data = weight[i * d:(i + 1) * d]
            if proj.bias is not None:
                proj.bias.data = bias[i * d:(i + 1) * d]
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unscaled queries, keys and values ``[..., H, Dh]`` in one GEMM (after ``fuse_qkv``)."""
        fused = F.linear(x, self.qkv_weight, self.qkv_bias).unflatten(-1, (3, self.num_heads, self.head_dim))
        return fused.unbind(-3)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-scaled queries ``[..., H, Dh]`` (attend with ``scale=1``)."""
        return (self.q_proj(x) * self.scale).unflatten(-1, (self.num_heads, self.head_dim))

    def key_value(self, x: torch.Tensor) -> CrossKV:
        """Keys and values ``[..., H, Dh]``."""
        shape = (self.num_heads, self.head_dim)
        return self.k_proj(x).unflatten(-1, shape), self.v_proj(x).unflatten(-1, shape)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """Merge heads ``[..., H, Dh]`` and project back to ``[..., d_model]``."""
        return self.out_proj(attn.flatten(-2))


class WhisperEncoderLayer(nn.Module):
    """Pre-norm block: bidirectional self-attention, then the feed-forward."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, d]`` -> ``[B, S, d]``."""
        h = self.self_attn_layer_norm(x)
        attn = self.self_attn
        q = attn.query(h).transpose(1, 2)  # [B, H, S, Dh]
        k, v = (t.transpose(1, 2) for t in attn.key_value(h))
        o = F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2)
        x = x + attn.output(o)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Two GELU convolutions (the second with stride 2), sinusoid-initialised learned
    positions, the encoder layers and a final norm (``model.encoder.`` keys)."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_mel_frames = config.num_mel_frames
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(config) for _ in range(config.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """``mel [B, n_mels, 2 * max_source_positions]`` -> ``[B, max_source_positions, d]``."""
        if mel.dim() != 3 or mel.shape[-1] != self.num_mel_frames:
            expected = f"[B, n_mels, {self.num_mel_frames}]"
            raise ValueError(f"expected mel {expected}, got {tuple(mel.shape)}")
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x))  # [B, d, S]
        # Positions first: the sum takes their [S, d] layout, so the one pass that adds them
        # also lays x out as a contiguous [B, S, d] (``contiguous`` is then a no-op).
        x = (self.embed_positions.weight + x.transpose(1, 2)).contiguous()
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoderLayer(nn.Module):
    """Pre-norm block: paged causal self-attention, cross-attention, feed-forward."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.self_attn = WhisperAttention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperAttention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(
        self,
        x: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        cross_cache: torch.Tensor,
        cross: CrossAttentionBatch,
    ) -> torch.Tensor:
        """``x [T, d]``; ``cross_cache`` ``[2, slots, frames, H, Dh]`` holds this layer's cross
        K/V of every slot, ``cross`` says which slot each token reads."""
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.query(h)
        k, v = self.self_attn.key_value(h)
        x = x + self.self_attn.output(paged_attention(q, k, v, kv_cache, meta, scale=1.0))

        q = self.encoder_attn.query(self.encoder_attn_layer_norm(x))  # [T, H, Dh]
        x = x + self.encoder_attn.output(cross_attention(q, cross_cache, cross))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))

    def forward_fused(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        cross_cache: torch.Tensor,
        cross: CrossAttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with fewer kernels: the residual stream is ``residual + delta`` (the add
        left pending), each residual add runs in one Triton kernel with the next LayerNorm,
        q/k/v come from one GEMM, and the attention kernels apply the 1/sqrt(d) scale (q is
        not multiplied). Cross-attention does not write the sink slot. Returns the pending
        ``(delta, residual)`` of the block's output. Steps of at most ``DECODE_GEMV_ROWS``
        rows take ``forward_gemv``."""
        if delta.shape[0] <= DECODE_GEMV_ROWS:
            return self.forward_gemv(delta, residual, meta, kv_cache, cross_cache, cross)
        attn, cross_attn = self.self_attn, self.encoder_attn
        h, x = _add_norm(delta, residual, self.self_attn_layer_norm)
        q, k, v = attn.qkv(h)
        a = attn.output(paged_attention(q, k, v, kv_cache, meta, scale=attn.scale))
        h, x = _add_norm(a, x, self.encoder_attn_layer_norm)
        q = cross_attn.q_proj(h).unflatten(-1, (cross_attn.num_heads, cross_attn.head_dim))
        c = cross_attn.output(cross_attention(q, cross_cache, cross, scale=cross_attn.scale, write_sink=False))
        h, x = _add_norm(c, x, self.final_layer_norm)
        return self.fc2(self.act(self.fc1(h))), x

    def forward_gemv(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        cross_cache: torch.Tensor,
        cross: CrossAttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_fused`` for a step of a few rows, every projection one Triton GEMV
        (``mstar.layers.triton_gemv``) that also does the element-wise work around it: the
        pending residual add + LayerNorm as the prologue of the qkv, cross q and fc1 kernels,
        the keys and values stored into the paged cache by the qkv kernel's epilogue (the
        attention then skips its write), GELU as fc1's epilogue, and each attention's KV
        splits merged in its decode kernel. Eight kernels a layer: three norm + GEMV, o, cross
        o, fc2, and the two attentions (a step with a prefill also runs the prefill kernel)."""
        from mstar.layers.triton_gemv import KVWrite, gemv, layernorm_gemv

        attn, cross_attn = self.self_attn, self.encoder_attn
        heads = (attn.num_heads, attn.head_dim)
        norm = self.self_attn_layer_norm
        qkv, x = layernorm_gemv(delta, residual, norm.weight, norm.bias, norm.eps, attn.qkv_weight, attn.qkv_bias,
                                kv_write=KVWrite(kv_cache, meta.slot_mapping, first=attn.q_proj.weight.shape[0]))
        q, k, v = qkv.unflatten(-1, (3, *heads)).unbind(-3)
        out = paged_attention(q, k, v, kv_cache, meta, scale=attn.scale, write_kv=False, merge_in_kernel=True)
        a = gemv(out.flatten(-2), attn.out_proj.weight, attn.out_proj.bias)
        norm, proj = self.encoder_attn_layer_norm, cross_attn.q_proj
        q, x = layernorm_gemv(a, x, norm.weight, norm.bias, norm.eps, proj.weight, proj.bias)
        out = cross_attention(q.unflatten(-1, (cross_attn.num_heads, cross_attn.head_dim)), cross_cache, cross,
                              scale=cross_attn.scale, write_sink=False, merge_in_kernel=True)
        c = gemv(out.flatten(-2), cross_attn.out_proj.weight, cross_attn.out_proj.bias)
        norm, exact_gelu = self.final_layer_norm, self.act is F.gelu
        h, x = layernorm_gemv(c, x, norm.weight, norm.bias, norm.eps, self.fc1.weight, self.fc1.bias, gelu=exact_gelu)
        return gemv(h if exact_gelu else self.act(h), self.fc2.weight, self.fc2.bias), x


def _add_norm(delta: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + delta), residual + delta)`` in one Triton kernel."""
    from mstar.layers.triton_fused import add_layernorm

    return add_layernorm(delta, residual, norm.weight, norm.bias, norm.eps)


class WhisperDecoder(nn.Module):
    """Token and learned position embeddings, decoder layers, final norm (``model.decoder.``)."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)  # Whisper is never split: one rank
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(config) for _ in range(config.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)
        self.fused_kernels = False  # ``WhisperForConditionalGeneration.use_fused_kernels``

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        cross_caches: list[torch.Tensor],
        cross: CrossAttentionBatch,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers) or len(cross_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV and cross K/V caches, "
                             f"got {len(kv_caches)} and {len(cross_caches)}")
        if cross.slots.shape[0] != meta.num_seqs:
            raise ValueError(f"expected cross K/V slots for {meta.num_seqs} sequences, got {cross.slots.shape[0]}")
        if self.fused_kernels:  # the embedding sum is the first pending residual add
            delta, x = self.embed_tokens(input_ids), self.embed_positions.weight[meta.positions]
            for layer, kv_cache, cross_cache in zip(self.layers, kv_caches, cross_caches):
                delta, x = layer.forward_fused(delta, x, meta, kv_cache, cross_cache, cross)
            return _add_norm(delta, x, self.layer_norm)[0]
        x = self.embed_tokens(input_ids) + self.embed_positions.weight[meta.positions]
        for layer, kv_cache, cross_cache in zip(self.layers, kv_caches, cross_caches):
            x = layer(x, meta, kv_cache, cross_cache, cross)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    """Encoder and decoder (the ``model.`` prefix of HF keys)."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)


class WhisperForConditionalGeneration(nn.Module):
    """Whisper speech-to-text model split into serving-friendly stages."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        self.config = config
        self.model = WhisperModel(config)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Decode steps with fewer kernels (``WhisperDecoderLayer.forward_fused``; Triton: CUDA,
        or the CPU under ``TRITON_INTERPRET=1``). Turning it on concatenates every decoder
        self-attention's q/k/v weights (the parameters stay views of them)."""
        if enabled:
            for layer in self.model.decoder.layers:
                layer.self_attn.fuse_qkv()
        self.model.decoder.fused_kernels = enabled

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Audio features ``[B, 1500, d_model]`` of log-mels ``[B, n_mels, 3000]``."""
        return self.model.encoder(mel)

    def cross_kv(self, audio_features: torch.Tensor) -> list[CrossKV]:
        """Per decoder layer, cross-attention keys and values ``[S, H, Dh]`` of ONE request's
        audio features ``[S, d_model]``."""
        if audio_features.dim() != 2:
            raise ValueError(f"expected audio features [S, d], got {tuple(audio_features.shape)}")
        layers = self.model.decoder.layers
        return [layer.encoder_attn.key_value(audio_features) for layer in layers]

    def write_cross_kv(self, audio_features: torch.Tensor, slots: torch.Tensor,
                       cross_caches: list[torch.Tensor]) -> None:
        """Project the audio features ``[N, S, d_model]`` of ``N`` requests to every decoder
        layer's cross-attention keys and values, written once into their ``slots`` ``[N]`` of
        ``cross_caches`` (per layer ``[2, slots, S, H, Dh]``) for all their decode steps."""
        if audio_features.dim() != 3 or audio_features.shape[0] != slots.shape[0]:
            raise ValueError(f"expected audio features [{slots.shape[0]}, S, d], got {tuple(audio_features.shape)}")
        for layer, cache in zip(self.model.decoder.layers, cross_caches, strict=True):
            keys, values = layer.encoder_attn.key_value(audio_features)
            cache[0].index_copy_(0, slots, keys.to(cache.dtype))
            cache[1].index_copy_(0, slots, values.to(cache.dtype))

    def decode(
        self,
        input_ids: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        cross_caches: list[torch.Tensor],
        cross: CrossAttentionBatch,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, d_model]`` of the step's ``T`` new tokens.

        Tokens sit at ``meta.positions``; causal self-attention reads and writes the paged
        ``kv_caches`` (one per decoder layer); every token cross-attends (no mask) to its
        sequence's slot of ``cross_caches`` (one per layer, written by ``write_cross_kv``).
        Decode-only steps run without host synchronisation under the Triton backend.
        """
        return self.model.decoder(input_ids, meta, kv_caches, cross_caches, cross)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` for hidden states ``[N, d_model]`` (tied output projection)."""
        return self.model.decoder.embed_tokens.logits(hidden)

    def kv_layout(self) -> tuple[int, int, int]:
        """``(num_layers, num_heads, head_dim)`` of the decoder self-attention paged caches."""
        config = self.config
        return config.decoder_layers, config.decoder_attention_heads, config.decoder_head_dim

    def cross_layout(self) -> tuple[int, int, int, int]:
        """``(num_layers, frames, num_heads, head_dim)`` of one request's cross-attention K/V."""
        config = self.config
        return (config.decoder_layers, config.max_source_positions, config.decoder_attention_heads,
                config.decoder_head_dim)
