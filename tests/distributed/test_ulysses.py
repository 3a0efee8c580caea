"""Ulysses sequence parallelism (mstar.layers.ulysses) on DiT attention: FLUX.2's
double-stream joint attention and single-stream fused attention + MLP, split over SP=2,
TP=2, TP=2 x SP=2 and SP=4 (gloo, 4 processes), equal our unsplit FLUX.2 modules
(``JointAttention``, ``ParallelSelfAttention``).

FLUX.2's attention calls a module-level function, so it cannot take an injected attention
without editing the model: the split modules below have the same parameter names and
maths, built from the tensor-parallel layers with ``UlyssesAttention`` at their core, and
load the reference modules' state dicts through the layers' weight loaders. The same
checks run over NCCL on four GPUs (``cuda``; skipped without them), every rank computing
the unsplit reference and its layouts on its own GPU in float32 without TF32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mstar.distributed import (
    ParallelState,
    all_to_all,
    broadcast,
    build_mesh,
    use_parallel,
)
from mstar.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from mstar.layers.rotary import apply_rotary_pairs
from mstar.layers.ulysses import UlyssesAttention, gather_sequence, shard_sequence
from mstar.model.flux2.rope import rope_cos_sin
from mstar.model.flux2.transformer import JointAttention, ParallelSelfAttention, swiglu
from mstar.model.weights import load_weights
from tests.distributed.helpers import devices, rank_device, rel_error, run_ranks

TOL = 1e-5
DIM, HEADS, HEAD_DIM, EPS, MLP_RATIO = 32, 4, 8, 1e-6, 3.0
MLP = int(DIM * MLP_RATIO)
AXES = (2, 2, 2, 2)
N_TXT, N_IMG, BATCH = 5, 11, 2  # odd lengths: shards of different sizes


class SplitJointAttention(nn.Module):
    """FLUX.2's double-stream joint attention with heads split by TP (column-parallel
    projections in, row-parallel out) and the sequence by SP (Ulysses around attention)."""

    def __init__(self) -> None:
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.to_q, self.to_k, self.to_v = (ColumnParallelLinear(DIM, inner, bias=False, block=HEAD_DIM)
                                           for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            ColumnParallelLinear(DIM, inner, bias=False, block=HEAD_DIM) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (
            nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(4))
        self.to_out = nn.ModuleList([RowParallelLinear(inner, DIM, bias=False, block=HEAD_DIM)])
        self.to_add_out = RowParallelLinear(inner, DIM, bias=False, block=HEAD_DIM)
        self.attention = UlyssesAttention()

    def forward(self, img: torch.Tensor, txt: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens: ``img [B, n_img, D]``, ``txt [B, n_txt, D]``, rope over ``[txt; img]``."""
        heads = (-1, HEAD_DIM)
        q = torch.cat([self.norm_added_q(self.add_q_proj(txt).unflatten(-1, heads)),
                       self.norm_q(self.to_q(img).unflatten(-1, heads))], dim=1)
        k = torch.cat([self.norm_added_k(self.add_k_proj(txt).unflatten(-1, heads)),
                       self.norm_k(self.to_k(img).unflatten(-1, heads))], dim=1)
        v = torch.cat([self.add_v_proj(txt).unflatten(-1, heads), self.to_v(img).unflatten(-1, heads)], dim=1)
        q, k = apply_rotary_pairs(q, *rope), apply_rotary_pairs(k, *rope)
        out = self.attention(q, k, v).flatten(2)
        txt_out, img_out = out.split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


class SplitSelfAttention(nn.Module):
    """FLUX.2's single-stream block core: one fused projection to ``[q | k | v | gate | value]``
    (each segment split by TP), Ulysses attention, one projection of ``[attention | swiglu]``
    back (row-parallel over both input segments)."""

    def __init__(self) -> None:
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.to_qkv_mlp_proj = MergedColumnParallelLinear(DIM, [inner] * 3 + [MLP] * 2, bias=False,
                                                          blocks=[HEAD_DIM] * 3 + [1, 1])
        self.norm_q, self.norm_k = nn.RMSNorm(HEAD_DIM, eps=EPS), nn.RMSNorm(HEAD_DIM, eps=EPS)
        self.to_out = RowParallelLinear(inner + MLP, DIM, bias=False, input_sizes=[inner, MLP])
        self.attention = UlyssesAttention()

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        q, k, v, gate, value = self.to_qkv_mlp_proj(x).split(self.to_qkv_mlp_proj.local_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
        q, k = apply_rotary_pairs(self.norm_q(q), *rope), apply_rotary_pairs(self.norm_k(k), *rope)
        out = self.attention(q, k, v).flatten(2)
        return self.to_out(torch.cat([out, swiglu(torch.cat([gate, value], dim=-1))], dim=-1))


def randomised(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return module.eval()


def inputs(device: torch.device) -> tuple[JointAttention, ParallelSelfAttention, torch.Tensor, torch.Tensor, tuple]:
    """The reference FLUX.2 attentions with random weights, image and text tokens, and the
    rope tables of the joint ``[text; image]`` sequence (drawn on the CPU, then on ``device``)."""
    torch.manual_seed(0)
    joint = randomised(JointAttention(DIM, HEADS, HEAD_DIM, EPS))
    single = randomised(ParallelSelfAttention(DIM, HEADS, HEAD_DIM, MLP_RATIO, EPS))
    img, txt = torch.randn(BATCH, N_IMG, DIM), torch.randn(BATCH, N_TXT, DIM)
    txt_ids = torch.stack([torch.zeros(N_TXT), torch.zeros(N_TXT), torch.zeros(N_TXT), torch.arange(N_TXT)], -1)
    rows, cols = torch.arange(N_IMG) // 4, torch.arange(N_IMG) % 4
    img_ids = torch.stack([torch.zeros(N_IMG), rows, cols, torch.zeros(N_IMG)], -1)
    rope = rope_cos_sin(torch.cat([txt_ids, img_ids]).to(device), AXES, 10000.0)
    return joint.to(device), single.to(device), img.to(device), txt.to(device), rope


def split_forward(state: ParallelState, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split modules on this rank's shard of the tokens, outputs gathered back whole."""
    joint, single, img, txt, (cos, sin) = inputs(device)
    with torch.device(device), use_parallel(state):
        split_joint, split_single = SplitJointAttention().eval(), SplitSelfAttention().eval()
    load_weights(split_joint, joint.state_dict().items())
    load_weights(split_single, single.state_dict().items())
    sp = state.sp
    local = [shard_sequence(t, sp, dim=0) for t in (cos[:N_TXT], cos[N_TXT:], sin[:N_TXT], sin[N_TXT:])]
    rope = (torch.cat(local[:2]), torch.cat(local[2:]))  # this rank's [txt; img] positions
    with torch.no_grad():
        img_out, txt_out = split_joint(shard_sequence(img, sp), shard_sequence(txt, sp), rope)
        joint_seq = torch.cat([txt, img], dim=1)  # the single-stream blocks' sequence
        single_out = split_single(shard_sequence(joint_seq, sp), (shard_sequence(cos, sp, dim=0),
                                                                 shard_sequence(sin, sp, dim=0)))
    return gather_sequence(img_out, sp), gather_sequence(txt_out, sp), gather_sequence(single_out, sp)


def _layouts(rank: int, world: int, device_kind: str = "cpu") -> dict[str, float]:
    device = rank_device(device_kind, rank)
    joint, single, img, txt, rope = inputs(device)
    with torch.no_grad():  # SP=1, TP=1: the unsplit model
        ref_img, ref_txt = joint(img, txt, rope)
        ref_single = single(torch.cat([txt, img], dim=1), rope)
    # Every process creates every group, in the same order (torch.distributed.new_group).
    sp2 = [build_mesh([0, 1], 1, 2), build_mesh([2, 3], 1, 2)]
    tp2 = [build_mesh([0, 1], 2, 1), build_mesh([2, 3], 2, 1)]
    layouts = {
        "sp=2": sp2[rank // 2],
        "tp=2 x sp=2": build_mesh(range(4), 2, 2),
        "sp=4": build_mesh(range(4), 1, 4),
        "tp=2": tp2[rank // 2],
    }
    errors = {}
    for name, state in layouts.items():
        assert state is not None
        img_out, txt_out, single_out = split_forward(state, device)
        errors[f"joint {name}"] = max(rel_error(img_out, ref_img), rel_error(txt_out, ref_txt))
        errors[f"single {name}"] = rel_error(single_out, ref_single)

    # The exchange itself: uneven shards go out and come back unchanged.
    sp = layouts["sp=4"].sp
    x = torch.arange(3 * (rank + 1) * 8, dtype=torch.float32, device=device).view(1, rank + 1, 8, 3) + 1000 * rank
    there = all_to_all(x, sp, scatter_dim=2, gather_dim=1, gather_sizes=[1, 2, 3, 4])
    back = all_to_all(there, sp, scatter_dim=1, gather_dim=2, scatter_sizes=[1, 2, 3, 4])
    exchange = {"shape": tuple(there.shape), "round trip": torch.equal(back, x)}
    tp = layouts["tp=2 x sp=2"].tp  # ranks (0, 1) and (2, 3): each gets its group leader's value
    exchange["broadcast"] = broadcast(torch.tensor([rank], device=device), tp, src=0).item()
    dist.barrier()
    return {"errors": errors, "exchange": exchange}


@pytest.mark.parametrize("device", devices(4))
def test_ulysses_sp_and_tp_x_sp_equal_unsplit_attention(device):
    for rank, result in enumerate(run_ranks(_layouts, 4, device, device=device)):
        for name, err in result["errors"].items():
            print(f"[ulysses {device} rank {rank}] {name}: max rel err {err:.2e}")
            assert err <= TOL, f"rank {rank} {name}: {err:.3e}"
        # all ranks' sequence pieces (1 + 2 + 3 + 4) of this rank's quarter of the heads
        assert result["exchange"] == {"shape": (1, 10, 2, 3), "round trip": True, "broadcast": rank - rank % 2}
