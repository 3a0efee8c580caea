"""S16: GLM-5.2's layers at the real shapes on one GPU, ours against transformers' modules.

The whole model needs several GPUs (docs/glm52.md); this times one layer of each kind, with the
same random weights on both sides, in bfloat16:

* **MoE layer** (hidden 6144, 256 experts of 2048, top 8, one shared expert): ours
  (``mstar.model.glm52.moe.Glm52MoE``, the Triton fused-MoE kernels on CUDA) against
  transformers' ``GlmMoeDsaMoE`` (its ``grouped_mm`` experts where it has them), at 1 and 64
  tokens (decode) and 4096 (prefill). The expert stacks are one tensor shared by both.
* **Command A+'s MoE layer** (``--parts cmda_moe``; hidden 8192, 128 experts of 2048, top 8
  with a softmax over the eight logits, one always-on shared expert of 2048 averaged with the
  routed sum): ours (``mstar.model.command_a_plus.modeling.CommandMoE``, the Triton fused-MoE
  kernels on CUDA) against transformers' ``Cohere2MoeSparseMoeBlock``, at the same token
  counts. The release's config.json is not at hand here: hidden 8192 is the Cohere family's,
  and the expert width 2048 the one that brings 32 such layers, their attention and the 256k
  tied vocabulary to ~215B of the stated 218B parameters (``--cmda-hidden`` and
  ``--cmda-expert`` change them).
* **MLA + DSA attention layer** (64 heads, q rank 2048, latent 512 + 64 rotary, indexer of 32
  heads x 128, top 2048): ours (``Glm52Attention`` over the paged latent cache) against
  ``GlmMoeDsaAttention`` over its own cache: decode of 1 and 64 rows, each over ``--context``
  cached tokens, and a prefill of 4096 tokens.

Each row holds the largest difference between the two outputs over the largest magnitude
(``notes.rel_err``). The floor: a decode moves at least the layer's weights (the experts the
step routes to) and the cached rows it reads, over the measured bandwidth; a prefill does at
least its products' FLOPs (the attention over the chosen keys included) at the measured
matmul rate.

    python benchmarks/s16_glm52_layers.py              # one H100/H200
    python benchmarks/s16_glm52_layers.py --parts cmda_moe   # Command A+'s MoE alone
    python benchmarks/s16_glm52_layers.py --smoke      # tiny shapes on the CPU

The smoke config has 16 indexer heads, not fewer: with few heads a key whose every head's
score is negative scores exactly 0 (the ReLU), and top-k among such ties is arbitrary (ours
and transformers' keys may then differ at the boundary; the real 32 heads make it vanishing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    add_run_args,
    free_device,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    record_parts,
    setup_logging,
    time_calls,
)

NAME = "s16_glm52_layers"
# Command A+'s MoE (issue 32): 128 experts, top 8, a shared expert averaged in
CMDA = dict(num_experts=128, num_experts_per_tok=8, num_shared_experts=1, shared_expert_combination_strategy="average",
            expert_selection_fn="softmax", num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8)
CMDA_SMOKE = dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=3)
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, index_n_heads=16, index_head_dim=16, index_topk=16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens of each decoding row")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill rows")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--parts", default="moe,attention,cmda_moe",
                        help="which layers to time (moe, attention: GLM-5.2's; cmda_moe: Command A+'s MoE)")
    parser.add_argument("--cmda-hidden", type=int, default=8192, help="Command A+'s hidden size")
    parser.add_argument("--cmda-expert", type=int, default=2048, help="Command A+'s expert width")
    add_run_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.context, args.prefill, args.repeats = 40, 48, 2
    return args


def hf_config(smoke: bool):
    from transformers import GlmMoeDsaConfig

    config = GlmMoeDsaConfig(num_hidden_layers=1, first_k_dense_replace=0, **(SMOKE if smoke else {}))
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer drawn anew (norms near one, matrices ~1/sqrt(fan-in))."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point():
            continue
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.1 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def median_s(op, device: torch.device, repeats: int) -> float:
    return statistics.median(time_calls(op, device, repeats, warmup=2))


# ------------------------------------------------------------------------------ MoE
def moe_pair(make_theirs, make_ours, seed: int, device: torch.device, dtype: torch.dtype):
    """transformers' MoE block (random weights) and ours, built in ``dtype`` on ``device``,
    with one expert stack for both (theirs, shared) and the router and shared expert copied."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            theirs = make_theirs().eval()
            randomize(theirs, seed)
            ours = make_ours().eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        ours.experts.gate_up.weight = torch.nn.Parameter(theirs.experts.gate_up_proj, requires_grad=False)
        ours.experts.down.weight = torch.nn.Parameter(theirs.experts.down_proj, requires_grad=False)
        ours.gate.weight.copy_(theirs.gate.weight)
        shared = theirs.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
    return theirs, ours


def moe_rows(args, device, dtype, bandwidth: float, tflops: float) -> list[Metric]:
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

    from mstar.layers.moe import use_moe_kernel
    from mstar.model.glm52.config import Glm52Config
    from mstar.model.glm52.moe import Glm52MoE

    config = hf_config(args.smoke)
    config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    ours_config = Glm52Config.from_dict(config.to_dict())
    theirs, ours = moe_pair(lambda: GlmMoeDsaMoE(config), lambda: Glm52MoE(ours_config), args.seed, device, dtype)
    with torch.no_grad():
        ours.gate.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
    free_device(device)
    use_moe_kernel(ours, "triton" if device.type == "cuda" else "loop")
    shape = MoEShape(config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok,
                     config.n_routed_experts, config.n_shared_experts, router_bytes=4)
    return moe_metrics("moe", ours, theirs, lambda x: ours.gate(x)[0], shape, args, device, dtype, bandwidth,
                       tflops, {"theirs_experts": config._experts_implementation})


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    inner: int
    top_k: int
    experts: int
    shared: int
    router_bytes: int  # per router weight


def moe_metrics(prefix: str, ours, theirs, route, shape: MoEShape, args, device, dtype, bandwidth: float,
                tflops: float, notes: dict) -> list[Metric]:
    """Rows ``{prefix}_decode@1``, ``@64`` and ``{prefix}_prefill@N``: ``ours(x [T, H])`` against
    ``theirs(x [1, T, H])`` on the same tokens; ``route(x)``: the expert ids ours picks."""
    expert_bytes = 3 * shape.hidden * shape.inner * dtype.itemsize
    rows = []
    for tokens, phase in ((1, "decode"), (64, "decode"), (args.prefill, "prefill")):
        x = torch.randn(tokens, shape.hidden, device=device, generator=torch.Generator(device).manual_seed(tokens),
                        dtype=torch.float32).to(dtype)
        with torch.no_grad():
            err = rel_err(ours(x), theirs(x[None])[0])
            touched = int(route(x).unique().numel())
            ours_s = median_s(lambda x=x: ours(x), device, args.repeats)
            theirs_s = median_s(lambda x=x: theirs(x[None]), device, args.repeats)
        if phase == "decode":  # the routed experts' weights, the shared expert's and the router's
            floor = ((touched + shape.shared) * expert_bytes + shape.experts * shape.hidden * shape.router_bytes) \
                / (bandwidth * 1e9)
        else:
            floor = 2 * tokens * (shape.top_k + shape.shared) * 3 * shape.hidden * shape.inner / (tflops * 1e12)
        rows.append(Metric(NAME, f"{prefix}_{phase}@{tokens}", "ms", "lower", 1e3 * ours_s, 1e3 * theirs_s,
                           1e3 * floor, notes={"rel_err": err, "experts_touched": touched, **notes}))
    return rows


def cmda_moe_rows(args, device, dtype, bandwidth: float, tflops: float) -> list[Metric]:
    """Command A+'s MoE layer, ours against transformers' ``Cohere2MoeSparseMoeBlock``."""
    from transformers import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeSparseMoeBlock

    from mstar.layers.moe import use_moe_kernel
    from mstar.model.command_a_plus.config import CommandAPlusConfig
    from mstar.model.command_a_plus.modeling import CommandMoE

    sizes = CMDA_SMOKE if args.smoke else dict(hidden_size=args.cmda_hidden, intermediate_size=args.cmda_expert)
    config = Cohere2MoeConfig(**{**CMDA, **sizes})
    config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    ours_config = CommandAPlusConfig.from_hf_dict(config.to_dict())
    theirs, ours = moe_pair(lambda: Cohere2MoeSparseMoeBlock(config), lambda: CommandMoE(ours_config), args.seed,
                            device, dtype)
    free_device(device)
    use_moe_kernel(ours, "triton" if device.type == "cuda" else "loop")
    shape = MoEShape(config.hidden_size, config.intermediate_size, config.num_experts_per_tok, config.num_experts,
                     config.num_shared_experts, router_bytes=dtype.itemsize)
    return moe_metrics("cmda_moe", ours, theirs, lambda x: ours.route(x)[0], shape, args, device, dtype, bandwidth,
                       tflops, {"theirs_experts": config._experts_implementation})


# ------------------------------------------------------------------------ attention
def paged_meta(lengths: list[int], new: list[int], page_size: int, device: torch.device):
    """Metadata of a step adding ``new[b]`` tokens to sequence ``b`` of ``lengths[b]`` tokens
    in all (pages laid out one sequence after another)."""
    from mstar.layers.paged_kv import PagedAttentionMetadata

    pages, positions, slots, starts, first = [], [], [], [0], 0
    for length, n in zip(lengths, new):
        count = -(-length // page_size)
        pages.append(list(range(first, first + count)))
        positions += list(range(length - n, length))
        slots += [first * page_size + p for p in range(length - n, length)]
        starts.append(starts[-1] + n)
        first += count
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages])
    meta = PagedAttentionMetadata(positions=torch.tensor(positions, device=device),
                                  slot_mapping=torch.tensor(slots, device=device),
                                  query_start_loc=torch.tensor(starts, device=device),
                                  seq_lens=torch.tensor(lengths, device=device),
                                  page_table=table.to(device), page_size=page_size,
                                  host_query_start_loc=tuple(starts), host_seq_lens=tuple(lengths))
    return meta, first


def attention_rows(args, device, dtype, bandwidth: float, tflops: float) -> list[Metric]:
    from transformers import DynamicCache
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention, GlmMoeDsaRotaryEmbedding

    from mstar.model.glm52.attention import Glm52Attention, rope_tables
    from mstar.model.glm52.config import Glm52Config

    config = hf_config(args.smoke)
    ours_config = Glm52Config.from_dict(config.to_dict())
    with torch.device(device):
        theirs = GlmMoeDsaAttention(config, 0).to(dtype).eval()
        randomize(theirs, args.seed)
        ours = Glm52Attention(ours_config, 0).to(dtype).eval()
        rotary = GlmMoeDsaRotaryEmbedding(config)
    ours.load_state_dict(theirs.state_dict())
    weights = sum(p.numel() for p in ours.parameters()) * dtype.itemsize
    width, page_size = ours_config.cache_width, 64
    heads, topk = config.num_attention_heads, config.index_topk
    gen = torch.Generator(device).manual_seed(args.seed)

    def theirs_step(x: torch.Tensor, start: int, cache) -> torch.Tensor:
        batch, n = x.shape[:2]
        positions = torch.arange(start, start + n, device=device)[None].expand(batch, -1)
        mask = torch.full((n, start + n), torch.finfo(dtype).min, device=device, dtype=dtype).triu(start + 1)
        return theirs(x, rotary(x, positions), mask[None, None].expand(batch, 1, -1, -1), cache=cache,
                      position_ids=positions)[0]

    def fill_theirs(kv: torch.Tensor, batch: int, length: int, count: int):
        """Their cache holding our first ``length`` cached rows of each sequence (the same
        latents, rotary and indexer keys: both keep the rotated channels de-interleaved)."""
        rows = kv.view(batch, count * page_size, width)[:, :length]
        rank, rope = ours_config.kv_lora_rank, ours_config.qk_rope_head_dim
        cache = DynamicCache(config=config)
        cache.update(rows[None, ..., :rank].transpose(0, 1).contiguous(),
                     rows[None, ..., rank:rank + rope].transpose(0, 1).contiguous(), 0)
        cache.update_indexer(rows[..., rank + rope:].contiguous(), 0)
        return cache

    rows = []
    for phase, batch, context in (("decode", 1, args.context), ("decode", 64, args.context),
                                  ("prefill", 1, args.prefill)):
        new = context if phase == "prefill" else 1
        x = torch.randn(batch, context, config.hidden_size, device=device, generator=gen).to(dtype)
        with torch.no_grad():
            meta, pages = paged_meta([context] * batch, [context] * batch, page_size, device)
            kv = torch.zeros(1, pages, page_size, 1, width, device=device, dtype=dtype)
            cos, sin = rope_tables(meta.positions, ours_config.qk_rope_head_dim, ours_config.rope_theta)
            ours(x.reshape(-1, x.shape[-1]), cos, sin, meta, kv, None)  # fills our cache
            step, _ = paged_meta([context] * batch, [new] * batch, page_size, device)
            cos, sin = rope_tables(step.positions, ours_config.qk_rope_head_dim, ours_config.rope_theta)
            last = x[:, -new:].reshape(-1, x.shape[-1])
            ours_out, _ = ours(last, cos, sin, step, kv, None)
            if phase == "decode":
                cache = fill_theirs(kv, batch, context - 1, pages // batch)
                theirs_out = theirs_step(x[:, -1:], context - 1, cache)
            else:
                theirs_out = theirs_step(x, 0, DynamicCache(config=config))
            err = rel_err(ours_out, theirs_out.reshape(-1, theirs_out.shape[-1]))
            ours_s = median_s(lambda a=(last, cos, sin, step, kv): ours(*a, None), device, args.repeats)
            if phase == "decode":  # their cache grows by a token a call: negligible against the context
                theirs_s = median_s(lambda x=x[:, -1:], c=cache: theirs_step(x, c.get_seq_length(), c), device,
                                    args.repeats)
            else:
                theirs_s = median_s(lambda x=x: theirs_step(x, 0, DynamicCache(config=config)), device, args.repeats)
        if phase == "decode":
            floor = (weights + batch * context * width * dtype.itemsize) / (bandwidth * 1e9)
        else:  # products of every token, then the attention over min(topk, position + 1) keys and the indexer
            keys = sum(min(topk, p + 1) for p in range(context))
            attend = 2 * keys * heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
            index = context * (context + 1) * config.index_n_heads * config.index_head_dim
            floor = (2 * context * weights / dtype.itemsize + attend + index) / (tflops * 1e12)
        rows.append(Metric(NAME, f"mla_dsa_{phase}@{batch}x{context}", "ms", "lower", 1e3 * ours_s, 1e3 * theirs_s,
                           1e3 * floor, notes={"rel_err": err}))
        free_device(device)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, dtype)
    parts = {"moe": moe_rows, "attention": attention_rows, "cmda_moe": cmda_moe_rows}
    return record_parts(NAME, parts, args, device, dtype, bandwidth, tflops)


if __name__ == "__main__":
    sys.exit(main())
