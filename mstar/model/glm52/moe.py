"""GLM-5.2's mixture of experts: DeepSeek-V3's router (sigmoid scores, a score-correction bias
that steers the choice but not the weights, group-limited top-k, the chosen weights
renormalised and scaled by ``routed_scaling_factor``) over the project's stacked experts
(``mstar.layers.moe.MoEExperts``), plus an always-on shared expert.

Tensor parallelism as ``mstar.layers.moe`` describes: the router whole on every rank (all route
alike), each expert and the shared expert split by their inner features, one all-reduce of the
ranks' partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_reduce
from mstar.distributed.state import current_parallel
from mstar.layers.mlp import SwiGLU
from mstar.layers.moe import MoEExperts
from mstar.model.glm52.config import Glm52Config


class Glm52Router(nn.Module):
    """``gate.weight [E, H]`` and ``gate.e_score_correction_bias [E]``, kept in float32 (the
    routing is computed in float32 whatever the model's dtype: ``Glm52ForCausalLM.to_dtype``)."""

    def __init__(self, config: Glm52Config) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.normalize = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [T, k], weights [T, k] float32)`` for tokens ``x [T, H]``."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        # Keep the topk_group groups whose two best biased scores sum highest, then the top_k experts in them.
        grouped = biased.view(x.shape[0], self.n_group, -1)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Glm52MoE(nn.Module):
    """Key names: ``mlp.gate.*``, ``mlp.experts.{i}.{gate,up,down}_proj.weight``,
    ``mlp.shared_experts.{gate,up,down}_proj.weight``."""

    def __init__(self, config: Glm52Config) -> None:
        super().__init__()
        self.tp = current_parallel().tp
        self.gate = Glm52Router(config)
        self.experts = MoEExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                     fused=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights.to(x.dtype))
        shared = self.shared_experts
        if self.tp.size == 1:
            return out + shared(x)
        # this rank's partial of the shared expert (its down_proj not reduced), summed with the experts' at once
        gate, up = shared.gate_up_proj.split_output(shared.gate_up_proj(x))
        return all_reduce(out + F.linear(F.silu(gate) * up, shared.down_proj.weight), self.tp)
