"""Sparse mixture-of-experts feed-forward: top-k routing over SwiGLU experts whose weights are
stacked ``[E, ...]``, so a kernel can run all experts from one call.

The expert computation is one function, ``fused_moe(x, topk_ids, topk_weights, w_gate_up,
w_down)``; the torch reference here groups the token-expert pairs by expert (one stable sort
of the flattened ids), runs one GEMM pair per expert over its contiguous rows and scatter-adds
the weighted rows back, or runs the two GEMMs of all experts as one ``torch._grouped_mm``
each (``grouped_mm``; bit-identical on the CPU here, and 20-25% faster at 64-512 tokens of
64 experts, top-8, H 256, one thread; slower at one token). On CUDA,
``mstar.layers.triton_moe.triton_fused_moe`` computes the same as two grouped-GEMM Triton
kernels (SiLU * up and the routing weights in their epilogues, no host sync). ``MoEExperts``
picks one of the three by its ``kernel`` attribute (``"loop"``, ``"grouped_mm"``,
``"triton"``); ``use_moe_kernel`` sets it on every expert stack of a model.

Checkpoints in the Hugging Face layout store every expert apart
(``experts.{i}.gate_proj.weight``, ``up_proj``, ``down_proj``); each stacked weight here is a
fused parameter with one segment per expert and projection, so ``load_weights`` fills a slice
per checkpoint tensor and counts the stack loaded only once every slice is. A stacked
checkpoint tensor under the parameter's own name (``experts.gate_up.weight``
``[E, 2I, H]``, ``experts.down.weight`` ``[E, H, I]``) loads whole through its weight loader.

Tensor parallelism (built under ``mstar.distributed.use_parallel``): every rank holds every
expert, but only its slice of each expert's ``I`` features (gate and up rows, down columns),
as a dense SwiGLU is split; the router stays whole on every rank, so all ranks route alike.
A rank's ``fused_moe`` then gives its partial sum of the expert outputs, the shared expert
(split the same way, its sigmoid gate whole) adds its partial, and one all-reduce sums them.
Loaders take this rank's slice out of the full per-expert or stacked tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_reduce
from mstar.distributed.state import Group, current_parallel
from mstar.layers.linear import set_weight_loader
from mstar.layers.mlp import SwiGLU


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k], topk_weights [T, k])``: softmax over the experts (in fp32), the ``k``
    largest probabilities, renormalised to sum to one when ``normalize`` (Qwen3-MoE's
    ``norm_topk_prob``); weights come back in the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor, *, grouped_mm: bool = False) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``.

    ``x [T, H]``; ``topk_ids``, ``topk_weights [T, k]``; ``w_gate_up [E, 2I, H]`` (rows
    ``[gate | up]``); ``w_down [E, H, I]``. A token routed to one expert twice counts twice;
    experts with no tokens cost nothing. ``grouped_mm``: the two GEMMs of all experts as one
    ``torch._grouped_mm`` each (no host sync, no Python loop; its rows need 16-byte aligned
    strides, so ``H`` and ``I`` a multiple of 4 in float32) instead of a loop over experts."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair p = token * k + slot, grouped by expert
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0])
    rows = x[token_of]
    if grouped_mm:
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        out_rows = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=ends)
    else:
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            end = start + count
            gate, up = F.linear(rows[start:end], w_gate_up[expert]).chunk(2, dim=-1)
            out_rows[start:end] = F.linear(F.silu(gate) * up, w_down[expert])
            start = end
    out_rows = out_rows * topk_weights.reshape(-1)[order, None].to(out_rows.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_rows)
    return out


class StackedExpertWeight(nn.Module):
    """One weight ``[E, rows, cols]`` made of ``len(parts)`` row segments per expert, loaded from
    the checkpoint's per-expert tensors ``<parent>.{i}.<part>.weight`` (``parts`` such as
    ``("gate_proj", "up_proj")``), each ``[part_rows, cols]`` in full.

    Under tensor parallelism ``split`` says which axis of a per-expert tensor is divided over
    the ranks: ``"rows"`` (gate and up: output features) or ``"cols"`` (down: input
    features); this rank keeps its contiguous share of that axis."""

    def __init__(self, num_experts: int, part_rows: int, cols: int, parts: tuple[str, ...], *,
                 split: str = "rows") -> None:
        super().__init__()
        if split not in ("rows", "cols"):
            raise ValueError(f"split {split!r}: 'rows' or 'cols'")
        tp = current_parallel().tp
        self.tp = tp
        self.split = split
        self.full_shape = (part_rows, cols)  # one expert's part, unsharded
        size = part_rows if split == "rows" else cols
        if size % tp.size:
            raise ValueError(f"cannot split the experts' {size} features evenly over {tp.size} tensor-parallel ranks")
        self.part_rows = part_rows // tp.size if split == "rows" else part_rows
        local_cols = cols // tp.size if split == "cols" else cols
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(num_experts, self.part_rows * len(parts), local_cols))
        self.segment_names = tuple(f"{i}.{part}" for i in range(num_experts) for part in parts)
        set_weight_loader(self.weight, self._load_stacked)

    def _shard(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's share of one expert's full part ``[..., part_rows, cols]``."""
        return part.chunk(self.tp.size, dim=-2 if self.split == "rows" else -1)[self.tp.rank]

    @torch.no_grad()
    def load_segment(self, param: nn.Parameter, index: int, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.full_shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {self.full_shape}")
        expert, part = divmod(index, len(self.parts))
        param[expert, part * self.part_rows:(part + 1) * self.part_rows].copy_(self._shard(tensor))

    @torch.no_grad()
    def _load_stacked(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """Every expert at once from the full stack ``[E, len(parts) * part_rows, cols]``."""
        rows, cols = self.full_shape
        expected = (param.shape[0], rows * len(self.parts), cols)
        if tuple(full.shape) != expected:
            raise ValueError(f"stacked tensor has shape {tuple(full.shape)}, the full (unsharded) stack "
                             f"has shape {expected} (this rank holds {tuple(param.shape)})")
        param.copy_(torch.cat([self._shard(p) for p in full.split(rows, dim=1)], dim=1))


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``inner``, stacked (see ``fused_moe``); under
    tensor parallelism each holds ``inner / tp_size`` of its features and ``forward`` returns
    this rank's partial sum (the caller all-reduces)."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = StackedExpertWeight(num_experts, inner, hidden, ("gate_proj", "up_proj"), split="rows")
        self.down = StackedExpertWeight(num_experts, hidden, inner, ("down_proj",), split="cols")

    # how the experts run: ``"loop"`` (``fused_moe``'s loop over experts, the reference),
    # ``"grouped_mm"`` (``fused_moe`` with ``torch._grouped_mm``) or ``"triton"`` (the
    # ``triton_fused_moe`` kernels: CUDA, or the CPU under Triton's interpreter)
    kernel: str = "loop"

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            from mstar.layers.triton_moe import triton_fused_moe  # Triton only when asked for

            return triton_fused_moe(x, topk_ids, topk_weights, self.gate_up.weight, self.down.weight)
        return fused_moe(x, topk_ids, topk_weights, self.gate_up.weight, self.down.weight,
                         grouped_mm=self.kernel == "grouped_mm")


MOE_KERNELS = ("loop", "grouped_mm", "triton")


def use_moe_kernel(module: nn.Module, kernel: str) -> int:
    """Run every ``MoEExperts`` inside ``module`` with ``kernel`` (one of ``MOE_KERNELS``);
    returns how many were switched."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"MoE kernel {kernel!r}: one of {', '.join(MOE_KERNELS)}")
    stacks = [m for m in module.modules() if isinstance(m, MoEExperts)]
    for stack in stacks:
        stack.kernel = kernel
    return len(stacks)


def moe_kernel(module: nn.Module) -> str | None:
    """The kernel of the first ``MoEExperts`` inside ``module`` (None without one)."""
    return next((m.kernel for m in module.modules() if isinstance(m, MoEExperts)), None)


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse block: a bias-free router ``gate [E, H]``, top-k of the softmax
    (renormalised when ``normalize``), the experts' weighted sum. Parameter names follow the
    Hugging Face checkpoints (``gate.weight``, ``experts.{i}.{gate,up,down}_proj.weight``).

    ``shared_inner > 0`` adds a shared expert every token takes (Qwen2-MoE's, and Qwen3-Omni's
    talker): a SwiGLU of width ``shared_inner`` (``shared_expert.{gate,up,down}_proj``) scaled
    per token by ``sigmoid(shared_expert_gate(x))`` (a ``[1, H]`` gate), added to the routed
    sum. At 0 (the default) the block has no such parameters and computes what it did without.

    Under tensor parallelism (see the module's docstring) the router and the shared expert's
    gate are whole on every rank, the experts and the shared expert hold a slice of their
    features, and the block's one all-reduce sums the ranks' partial outputs."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int, normalize: bool,
                 shared_inner: int = 0) -> None:
        super().__init__()
        self.top_k = top_k
        self.normalize = normalize
        self.tp: Group = current_parallel().tp
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden, inner)
        self.shared_expert = SwiGLU(hidden, shared_inner, fused=True) if shared_inner > 0 else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inner > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = route_topk(self.gate(flat), self.top_k, self.normalize)
        out = self.experts(flat, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self._shared(flat)
        return all_reduce(out, self.tp).reshape(shape)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, or under tensor parallelism this rank's partial of it
        (``down_proj`` without its own all-reduce: the block sums once, the per-token gate
        being the same on every rank)."""
        expert = self.shared_expert
        if self.tp.size == 1:
            return expert(flat)
        gate, up = expert.gate_up_proj.split_output(expert.gate_up_proj(flat))
        return F.linear(F.silu(gate) * up, expert.down_proj.weight)
