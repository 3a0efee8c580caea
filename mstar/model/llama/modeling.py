"""Llama-architecture decoder on a paged KV cache.

Parameter names are the Hugging Face checkpoint keys, except for the fused projections:
``self_attn.qkv_proj`` (``[q | k | v]``, one GEMM) and ``mlp.gate_up_proj`` (``[gate | up]``).
``mstar.model.weights.load_weights`` fills them from the unfused keys (``q_proj``, ``k_proj``,
``v_proj``, ``gate_proj``, ``up_proj``) through the layers' segment loaders, so HF and GGUF
checkpoints load unchanged (``load_state_dict`` with HF keys does not). With tied embeddings
there is no ``lm_head`` at all: the logits reuse ``model.embed_tokens.weight``.

Tensor parallelism lives in the layers (``mstar.layers.linear``): built under a parallel
state (``mstar.distributed.use_parallel``), each rank holds its share of the heads, MLP
features and vocabulary, and the head counts here are read back from the layers. Built
outside one, every layer is its plain ``torch.nn`` counterpart.

``use_fused_kernels(True)`` (``model_kwargs.fused_kernels``) runs the step's element-wise work
as Triton kernels (``mstar.layers.triton_fused``): residual add + RMSNorm, SiLU * up and RoPE
in place. The layers pick the kernel themselves; eager torch stays the default and reference.
In decode steps of up to 64 rows the decoder layer also runs some of its projections as the
GEMV kernels of ``mstar.layers.triton_gemv``, as the measured rule ``DECODE_GEMV`` says per
projection and row count (at one or two rows all four: norm + qkv, o, norm + gate_up + SiLU *
up, down), with the same sums and rounding points.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.attention import group_attention, paged_attention
from mstar.layers.linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mstar.layers.mlp import SwiGLU
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import DecodeGroup, PagedAttentionMetadata, write_kv_cache, write_kv_cache_whole
from mstar.layers.quantized import Int4Weight, SplitInt8Weight
from mstar.layers.rotary import RotaryEmbedding, apply_rotary_qk
from mstar.layers.triton_prefetch import L2Prefetch, PrefetchPlan
from mstar.model.llama.config import LlamaConfig


@dataclass(frozen=True)
class GemvRule:
    """Which projections of a decode step run as the Triton GEMV kernels of
    ``mstar.layers.triton_gemv``, by the step's row count (``fused_kernels`` on): each field is
    the most rows at which that projection takes its kernel (0: never; cuBLAS otherwise). Up
    to ``norm_prologue`` rows add + RMSNorm is the prologue of the qkv and gate_up kernels
    (every program re-derives the rows' statistics, a cost that grows with the rows; it needs
    ``qkv`` and ``gate_up`` at least as high); above, it is one ``add_rmsnorm`` kernel before
    them. A gate_up kernel always applies SiLU * up as its epilogue."""

    qkv: int
    o: int
    gate_up: int
    down: int
    norm_prologue: int

    @property
    def max_rows(self) -> int:
        """Steps of more rows take ``LlamaDecoderLayer.forward`` whole."""
        return max(self.qkv, self.o, self.gate_up, self.down)


DECODE_GEMV = GemvRule(qkv=2, o=16, gate_up=64, down=2, norm_prologue=0)
"""The rule the decoder uses. From ``benchmarks/check_gemv.py`` on an H200 at the Llama-3.1-8B
shapes (bf16, us per launch in a CUDA graph, weights cycled past the L2; two runs on
2026-12-03, the second's figures), cuBLAS = add_rmsnorm + cuBLAS (+ silu_and_mul), ours =
add_rmsnorm + our GEMV (+ its SiLU * up epilogue), at 4 / 8 / 16 / 32 / 64 rows:

* gate_up: cuBLAS 61.4 / 61.7 / 62.3 / 64.0 / 69.2, ours 59.7 / 59.5 / 60.0 / 62.9 / 64.1
  (3.9 to 3.7 TB/s): ours at every row count.
* o: cuBLAS 12.6 / 12.6 / 12.8 / 12.9 / 11.6, ours 11.5 / 11.5 / 11.6 / 12.6 / 14.8: ours up
  to 16 rows (at 32 it won by 0.3 and 0.6 us in the two runs, too little to take).
* qkv: cuBLAS 18.7 / 18.4 / 18.5 / 18.8 / 19.2, ours 18.5 / 18.5 / 18.5 / 19.4 / 21.6: a tie
  to 16 rows, a loss above: cuBLAS.
* down: cuBLAS 31.5 / 31.7 / 32.0 / 33.5 / 36.2, ours 31.2 / 31.3 / 31.3 / 32.8 / 35.5, in
  the first run a tie within 0.3 us at every count: cuBLAS.
* The norm as a prologue (``rmsnorm_gemv``) costs more than a kernel of its own from 4 rows
  (qkv 22.2 against 18.5 us at 4 rows, 121 against 21.6 at 64): it stays at 1-2 rows.

Per layer the rule saves 2.8 / 3.3 / 3.5 / 1.1 / 5.1 us (first run 2.5 / 3.0 / 2.8 / 1.1 /
3.0). A whole captured 32-layer step (``benchmarks/check_decode_step.py``, context 128) took
3.9 / 4.0 / 4.5 / 1.1 / 2.9% less (4.653 -> 4.473 ms at 4 rows, 5.175 -> 5.026 ms at 64),
more than the per-layer sums predict. Rows 1-2 run all four projections on the GEMV kernels,
the norm a kernel of its own as above: the same day's ``check_decode_step.py --rows 1 2
--rules before no_prologue`` on the H200 timed a whole step at 4.603 ms with the norm as the
qkv and gate_up kernels' prologue (the rule since the 1-row path was added) and 4.419 ms
without (-4.0%; 2 rows 4.619 -> 4.424), so ``norm_prologue`` is 0. (When the prologue path
was added it had measured 7.0 us a layer less than cuBLAS; on 2026-12-03 its prologue
kernels were the slower ones: qkv 19.8 against 18.1 us, gate_up 67.2 against 60.2.)"""


COMPILED_MAX_ROWS = 16
"""Decode steps in one key block of at most this many rows take the whole-step graph of
``use_compile``; other steps take the per-layer graphs at one row only (``LAYER_GRAPH_MAX_ROWS``)
and run eagerly above it. With our block-quantised kernels (``mstar.layers.native_cpu``, which
the graphs call as they are) or float weights. Measured on the 2-core test VM (SmolLM2 Q4_1,
``benchmarks/cpu_decode_step.py``, 2026-12-05, docs/benchmarks.md): compiled against eager,
1 / 8 / 16 streams 8.3 / 22.3 / 40.4 against 14.2 / 28.0 / 44.7 ms a step, greedy tokens
equal. Served (8 chat requests at once, whose sequences cross key blocks at different steps)
the per-layer graphs at eight rows lost to eager: 200-207 against ~258 tok/s; with them at one
row only, 258-318."""

LAYER_GRAPH_MAX_ROWS = 1
"""The most rows a step may have to take the per-layer graphs (two a layer, each paying
dynamo's guards and wrappers, around the eager attention)."""

TORCH_INT4_COMPILED_MAX_ROWS = 1
"""The cap where the products are PyTorch's int4 kernel (``Int4Weight``, ``SplitInt8Weight``: no
C++ compiler for ours): inductor lowers that kernel its own way, and an eight-row step took
44.4 ms compiled against 37.8 eager (2026-12-04), one row 15.3 against 16.2."""


L2_PREFETCH = PrefetchPlan.parse(os.environ.get("MSTAR_L2_PREFETCH", ""))
"""How much of which projection's weights ``forward_gemv`` fetches into L2 from a side stream
before their kernels (``mstar.layers.triton_prefetch``); off unless ``MSTAR_L2_PREFETCH`` says."""

_L2 = L2Prefetch()


def compiled_row_cap(model: nn.Module) -> int:
    """The most rows a step of ``model`` may have to take its compiled graphs."""
    torch_int4 = any(isinstance(getattr(m, "qweight", None), (Int4Weight, SplitInt8Weight)) for m in model.modules())
    return min(COMPILED_MAX_ROWS, TORCH_INT4_COMPILED_MAX_ROWS) if torch_int4 else COMPILED_MAX_ROWS


def kv_cache_shape(config: LlamaConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of the whole model's KV cache (a
    tensor-parallel rank holds a share of the heads: see ``LlamaForCausalLM.cache_shape``)."""
    assert config.num_key_value_heads is not None and config.head_dim is not None
    return config.num_hidden_layers, config.num_key_value_heads, config.head_dim


@functools.cache
def compiled_layer(backend: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``LlamaDecoderLayer.before_attention``, ``after_attention`` and ``decode_attention_on``
    compiled with ``backend``, once per process: every layer of every model shares them
    (guards on the layer's type and shapes, not its identity, so 30 layers trace once)."""
    # inductor's own loops single-threaded: at decode sizes (a few rows of ~1k) an OpenMP region
    # costs more than its work, and when the cores are shared its barrier waits for a
    # descheduled thread; the products (ATen's int4 and float kernels) keep their threads
    options = {"cpp.threads": 1} if backend == "inductor" else None
    return tuple(torch.compile(fn, backend=backend, options=options) for fn in (
        LlamaDecoderLayer.before_attention, LlamaDecoderLayer.after_attention, LlamaDecoderLayer.decode_attention_on))


STEP_INDUCTOR_OPTIONS = {"cpp.threads": 1, "size_asserts": False, "cpp_wrapper": True}
"""inductor's options for the whole-step graph (``compiled_step``). ``cpp.threads``: as
``compiled_layer``. The other two cut the graph's own host work, which at one row is a large
part of the step: ``size_asserts`` off drops a size and stride check per buffer (~580 a step
for SmolLM2), ``cpp_wrapper`` calls the kernels from C++ instead of a Python function. Measured
on the 2-core test VM (docs/cpu-compile.md): with both, a one-stream SmolLM2 step took ~9 ms
against ~10.4 ms without; the price is start-up: a cold build of the graph took 164 against
85 s (~12 s more than eager once inductor's disk cache holds it)."""


@functools.cache
def compiled_step(backend: str) -> Callable[..., Any]:
    """``LlamaModel.decode_group_step`` compiled with ``backend``, once per process: the whole
    decode step of one ``DecodeGroup`` (every layer, cache writes included) as one graph."""
    options = STEP_INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(LlamaModel.decode_group_step, backend=backend, options=options)


def one_decode_group(meta: PagedAttentionMetadata, rows: int) -> DecodeGroup | None:
    """The step's ``DecodeGroup`` when it is the whole step in order (a decode step of
    sequences whose KV lengths share a key block) on the torch backend; else None."""
    if meta.backend != "torch":
        return None
    groups, _ = meta.decode_groups
    if len(groups) != 1 or len(groups[0].rows) != rows or groups[0].rows != list(range(rows)):
        return None
    return groups[0]


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE, reading and writing one layer's paged cache.

    ``num_heads`` and ``num_kv_heads`` are the heads this module holds (all of them, or a
    tensor-parallel rank's share). With ``fused_kernels``, RoPE rotates q and k in place
    inside the qkv output and writes k and v to the paged cache (one kernel)."""

    fused_kernels: bool = False

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        _, kv_heads, self.head_dim = kv_cache_shape(config)
        self.scale = self.head_dim**-0.5
        hidden, bias, d = config.hidden_size, config.attention_bias, self.head_dim
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, d, heads, kv_heads, bias=bias,
                                          segment_names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=bias, block=d)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos_sin, meta, kv_cache))

    def attend(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """RoPE, cache write and attention on the ``qkv_proj`` output ``[T, q | k | v]``:
        the attention output ``[T, heads * head_dim]``, before ``o_proj``."""
        tokens = qkv.shape[0]
        q, k, v = (part.view(tokens, -1, self.head_dim) for part in self.qkv_proj.split_output(qkv))
        q, k = self.normalize_qk(q, k)
        cos, sin = cos_sin
        if self.fused_kernels:  # one kernel rotates q and k in place and writes k and v to the cache
            from mstar.layers.triton_fused import rotary_

            rotary_(q, k, cos, sin, v=v, kv_cache=kv_cache, slot_mapping=meta.slot_mapping)
            out = paged_attention(q, k, v, kv_cache, meta, self.scale, write_kv=False)
        else:
            q, k = apply_rotary_qk(q, k, cos, sin)
            out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return out.reshape(tokens, -1)

    def rotated_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v [T, heads, head_dim]`` of a ``qkv_proj`` output, q and k normalised
        (``normalize_qk``) and rotated: what ``attend`` feeds the attention, without it (the
        compiled CPU step, ``LlamaDecoderLayer.forward``, runs this part as a graph)."""
        tokens = qkv.shape[0]
        q, k, v = (part.view(tokens, -1, self.head_dim) for part in self.qkv_proj.split_output(qkv))
        q, k = apply_rotary_qk(*self.normalize_qk(q, k), cos, sin)
        return q, k, v

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[T, heads, head_dim]`` before RoPE: as they are (Qwen3 normalises
        each head here)."""
        return q, k


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The residual stream travels beside the block's output instead of being added at its end:
    a layer takes ``(delta, residual)`` (the previous layer's MLP output and the stream before
    it; the embeddings and ``None`` for the first layer) and returns its own pair, so every
    residual add happens inside the next norm (``norm(delta, residual)``), which fuses the two
    (one kernel with ``fused_kernels``). The sums and their rounding are those of the plain
    ``x + ...`` form.

    With ``fused_kernels``, a step of at most ``DECODE_GEMV.max_rows`` rows takes ``forward_gemv``."""

    fused_kernels: bool = False
    attention_cls: type[LlamaAttention] = LlamaAttention  # a variant's attention (Qwen3's q/k norms)
    # ``use_compile``: the compiled ``before_attention``, ``after_attention`` and
    # ``decode_attention_on`` (None: eager)
    compiled: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None
    compiled_rows: int = LAYER_GRAPH_MAX_ROWS  # steps of at most this many rows take ``compiled``

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, fused=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernels and 0 < x.shape[0] <= DECODE_GEMV.max_rows:
            return self.forward_gemv(x, residual, cos_sin, meta, kv_cache)
        if self.compiled is not None and x.shape[0] <= self.compiled_rows:
            before, after, decode_rest = self.compiled
            if residual is None:  # the first layer: the graphs always take a stream (x + 0 is x)
                x, residual = torch.zeros_like(x), x
            q, k, v, residual = before(self, x, residual, *cos_sin)
            group = one_decode_group(meta, x.shape[0])
            if group is not None:  # the cache written eagerly: a graph's write would copy the whole cache
                write_kv_cache(k, v, kv_cache, meta.slot_mapping)
                return decode_rest(self, q, kv_cache, group.head_slots(kv_cache.shape[-2], q.device), group.padding,
                                   residual)
            out = paged_attention(q, k, v, kv_cache, meta, self.self_attn.scale)
            return after(self, out.reshape(x.shape[0], -1), residual)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos_sin, meta, kv_cache), residual)
        return self.mlp(h), residual

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: add + norm, qkv, q/k norms, RoPE; ``q, k, v`` and
        the residual stream. The same ops in the same order as ``forward``'s eager path."""
        h, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.rotated_qkv(self.self_attn.qkv_proj(h), cos, sin), residual)

    def decode_in_group(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor, head_slots: torch.Tensor,
                        padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a decode step whose rows are one ``DecodeGroup`` in order, tensors
        only (``LlamaModel.decode_group_step`` traces every layer's as one graph): the same
        ops as the eager path, the cache written by ``write_kv_cache_whole``."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        q, k, v = self.self_attn.rotated_qkv(self.self_attn.qkv_proj(h), cos, sin)
        write_kv_cache_whole(k, v, kv_cache, slot_mapping)
        return self.decode_attention_on(q, kv_cache, head_slots, padding, residual)

    def decode_attention_on(self, q: torch.Tensor, kv_cache: torch.Tensor, head_slots: torch.Tensor,
                            padding: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its queries on, for a decode step whose rows are one ``DecodeGroup``
        in order (every sequence one token, KV lengths in one key block), its K/V already in
        the cache: ``group_attention`` (the torch backend's decode arithmetic), then
        ``after_attention``; tensors only, so that one compiled graph holds it."""
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        out = group_attention(q, flat, head_slots, padding, self.self_attn.scale)
        return self.after_attention(out.reshape(q.shape[0], -1), residual)

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention output ``[T, heads * head_dim]`` on: o, add + norm,
        MLP; the layer's ``(delta, residual)``."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(out), residual)
        return self.mlp(h), residual

    def forward_gemv(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a decode step, its projections as the GEMV kernels where
        ``DECODE_GEMV`` says so for this row count: add + norm + qkv, o (+ the all-reduce under
        tensor parallelism), add + norm + gate_up + SiLU * up, down (+ all-reduce); up to
        ``norm_prologue`` rows the adds and norms are the qkv and gate_up kernels' prologues.
        The others run as in ``forward`` (the fused element-wise kernels and cuBLAS). The
        weights are this rank's shards, as in ``forward``."""
        from mstar.layers.triton_fused import silu_and_mul
        from mstar.layers.triton_gemv import gemv, rmsnorm_gemv

        attn, mlp, rule, rows = self.self_attn, self.mlp, DECODE_GEMV, x.shape[0]

        def norm_then(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, proj: nn.Module,
                      limit: int, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
            if rows <= rule.norm_prologue:
                return rmsnorm_gemv(x, residual, norm.weight, norm.eps, proj.weight, proj.bias, silu_mul=silu_mul)
            h, residual = (norm(x), x) if residual is None else norm(x, residual)
            if rows <= limit:
                return gemv(h, proj.weight, proj.bias, silu_mul=silu_mul), residual
            return (silu_and_mul(proj(h)) if silu_mul else proj(h)), residual

        plan = L2_PREFETCH if L2_PREFETCH.active and rows <= L2_PREFETCH.max_rows else None
        if plan:
            _L2.fetch(attn.qkv_proj.weight, plan.qkv)
        qkv, residual = norm_then(self.input_layernorm, x, residual, attn.qkv_proj, rule.qkv, False)
        if plan:
            _L2.fetch(attn.o_proj.weight, plan.o)
        out = attn.attend(qkv, cos_sin, meta, kv_cache)
        h = attn.o_proj(out, linear=gemv) if rows <= rule.o else attn.o_proj(out)
        if plan:
            _L2.fetch(mlp.gate_up_proj.weight, plan.gate_up)
        act, residual = norm_then(self.post_attention_layernorm, h, residual, mlp.gate_up_proj, rule.gate_up, True)
        out = mlp.down_proj(act, linear=gemv) if rows <= rule.down else mlp.down_proj(act)
        if plan:
            _L2.join()
        return out, residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (the ``model.`` prefix of HF keys)."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # ``use_compile``: the compiled ``decode_group_step`` (None: eager)
    compiled_step: Callable[..., Any] | None = None
    compiled_rows: int = COMPILED_MAX_ROWS  # steps of at most this many rows take ``compiled_step``

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        _, _, head_dim = kv_cache_shape(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        meta: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        cos_sin = self.rotary_emb.cos_sin(meta.positions, x.dtype)
        if self.compiled_step is not None and x.shape[0] <= self.compiled_rows:
            group = one_decode_group(meta, x.shape[0])
            if group is not None:
                return self.compiled_step(self, x, *cos_sin, kv_caches, meta.slot_mapping,
                                          group.head_slots(kv_caches[0].shape[-2], x.device), group.padding)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos_sin, meta, kv_cache)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def decode_group_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                          slot_mapping: torch.Tensor, head_slots: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """``forward`` from the embeddings ``x`` on for a decode step whose rows are one
        ``DecodeGroup`` in order (``one_decode_group``: its ``head_slots`` and ``padding``), tensors
        only: ``use_compile`` runs it as one graph, so that a step pays for one call and one
        guard check instead of two a layer."""
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.decode_in_group(x, residual, cos, sin, kv_cache, slot_mapping, head_slots, padding)
        return self.norm(x, residual)[0]


def use_fused_kernels(root: nn.Module, enabled: bool = True) -> None:
    """Switch every Llama-style layer under ``root`` (norms, SwiGLU, attention, decoder
    layers: a model that embeds ``LlamaModel`` decoders, such as a TTS talker) to the fused
    Triton kernels, or back to eager torch."""
    for module in root.modules():
        if isinstance(module, (RMSNorm, SwiGLU, LlamaAttention, LlamaDecoderLayer)):
            module.fused_kernels = enabled


class LlamaForCausalLM(nn.Module):
    """Llama decoder with a language-model head, running one paged step per ``forward``."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        meta: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the ``T`` new tokens of the step.

        ``inputs_embeds [T, hidden]``, when given, replaces the embedding lookup.
        """
        return self.model(input_ids, meta, kv_caches, inputs_embeds)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Switch the element-wise work of every step to the fused Triton kernels (CUDA
        tensors, or CPU ones under Triton's interpreter) or back to eager torch."""
        use_fused_kernels(self, enabled)

    @property
    def fused_kernels(self) -> bool:
        """Whether ``use_fused_kernels`` is on."""
        return self.model.norm.fused_kernels

    def use_compile(self, backend: str | None = "inductor") -> None:
        """Run the decoder as ``torch.compile``d graphs (``model_kwargs.compile``; None: back
        to eager), for steps of at most ``compiled_row_cap`` rows. A decode step whose
        sequences share one key block (``one_decode_group``) is one graph from the embeddings
        to the final norm, cache writes included (``LlamaModel.decode_group_step``). Any other
        step runs each layer as two graphs around an eager cache write and attention (its
        gathers planned on the host): the work before the attention, then the rest.
        The graphs take the model or layer as an argument (its weights are graph inputs), so
        the 30 layers share theirs and models of one shape share the step's; they are traced
        on first use: one row, then any row count and key length (automatic dynamic shapes);
        ``mstar.model.decode_engines.warm_compiled`` traces them before serving."""
        graphs = None if backend is None else compiled_layer(backend)
        rows = compiled_row_cap(self)
        for layer in self.model.layers:
            layer.compiled, layer.compiled_rows = graphs, min(rows, LAYER_GRAPH_MAX_ROWS)
        self.model.compiled_step = None if backend is None else compiled_step(backend)
        self.model.compiled_rows = rows

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` (e.g. to splice in other modalities)."""
        return self.model.embed_tokens(input_ids)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache this module fills:
        a tensor-parallel rank caches the KV heads it holds."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (the whole vocabulary, on every rank) for hidden states
        ``[N, hidden]``; with tied embeddings the projection is ``model.embed_tokens``."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.logits(hidden)
        return self.lm_head(hidden)
