"""The FLUX.2 DiT split over ranks (gloo, 4 processes) equals the unsplit DiT.

One checkpoint folder written by diffusers' ``Flux2Transformer2DModel`` (its key layout)
loads at every layout through the layers' weight loaders. The whole forward (text and image
tokens, a batch of 2 requests at different timesteps) at SP=2, TP=2, TP=2 x SP=2 and SP=4
equals SP=1 within 1e-5 on every rank. Token counts are odd, so sequence shards differ in
length, and at SP=4 one rank holds no text token at all. One Euler step of two batched
requests through the denoise engine that ``Flux2Klein.build_engines`` builds under an SP=2
state equals the same step at SP=1. The same checks run over NCCL on four GPUs (``cuda``;
skipped without them): each rank builds every layout on its own GPU in float32 without TF32
and compares it with SP=1 computed there too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mstar.config import parse_config
from mstar.distributed import SINGLE, ParallelState, build_mesh, use_parallel
from mstar.engine.base import EngineItem
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.model import Flux2Klein
from mstar.model.flux2.positions import image_ids, text_ids
from mstar.model.flux2.transformer import Flux2Transformer
from mstar.model.weights import iter_safetensors, load_weights
from mstar.runtime.placement import build_placement
from tests.distributed.helpers import devices, rank_device, rel_error, run_ranks

TOL = 1e-5
HEADS, HEAD_DIM, MLP = 4, 8, 96  # inner width 32, mlp_ratio 3
CONFIG = dict(patch_size=1, in_channels=8, out_channels=None, num_layers=1, num_single_layers=1,
              attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=12,
              timestep_guidance_channels=16, mlp_ratio=3.0, axes_dims_rope=(2, 2, 2, 2), rope_theta=2000,
              eps=1e-6, guidance_embeds=True)
ROWS, COLS, N_TXT, BATCH = 3, 5, 3, 2  # 15 image and 3 text tokens: uneven shards, an empty one at SP=4
STEPS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A FLUX.2 model folder whose ``transformer/`` diffusers wrote (config and safetensors)."""
    from diffusers import Flux2Transformer2DModel  # the spawned ranks need no diffusers

    root = tmp_path_factory.mktemp("flux2")
    model = Flux2Transformer2DModel(**CONFIG).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large weights: every path moves the output
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.5 * noise if p.ndim == 1 else noise * 2 / math.sqrt(p.shape[1]))
    model.save_pretrained(root / "transformer")
    return root, model


def forward_inputs() -> tuple:
    """Two requests at different timesteps and guidance; image ids per request, as the
    engine passes them, text ids shared."""
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, ROWS * COLS, CONFIG["in_channels"], generator=generator)
    text = torch.randn(BATCH, N_TXT, CONFIG["joint_attention_dim"], generator=generator)
    img_ids = image_ids(ROWS, COLS).expand(BATCH, -1, -1)
    return latents, text, torch.tensor([0.3, 0.85]), img_ids, text_ids(N_TXT), torch.tensor([3.5, 1.0])


def step_items() -> list[EngineItem]:
    """Two requests of one shape at different steps of their schedules."""
    generator = torch.Generator().manual_seed(2)
    params = {"num_steps": STEPS, "image_seq_len": ROWS * COLS, "rows": ROWS, "cols": COLS}
    return [EngineItem(f"r{i}", "step", iteration,
                       {"latents": torch.randn(ROWS * COLS, CONFIG["in_channels"], generator=generator),
                        "text": torch.randn(N_TXT, CONFIG["joint_attention_dim"], generator=generator)},
                       dict(params))
            for i, iteration in enumerate((0, 2))]


def build_dit(root: Path, state: ParallelState, device: torch.device) -> Flux2Transformer:
    config = Flux2TransformerConfig.from_dict(json.loads((root / "transformer" / "config.json").read_text()))
    with torch.device(device), use_parallel(state):
        dit = Flux2Transformer(config)
    load_weights(dit, iter_safetensors(root / "transformer"))
    return dit.eval()


def denoise_step(root: Path, state: ParallelState, device: torch.device) -> tuple[list[torch.Tensor], list[int]]:
    """One step of ``step_items`` through the DiT engine the model declaration builds (its
    latents back on the CPU)."""
    spec = Flux2Klein(parse_config({"model": "flux2_klein", "model_path": str(root), "dtype": "float32"}))
    with use_parallel(state):
        engine = spec.build_engines({"dit"}, device)["dit"]
    outputs = engine.run(step_items())
    return [out.outputs["latents"].cpu() for out in outputs], list(engine.forward_rows)


def _split_runs(rank: int, world: int, root: Path, device_kind: str = "cpu") -> dict:
    device = rank_device(device_kind, rank)
    inputs = tuple(t.to(device) for t in forward_inputs())
    # Every process creates every group, in the same order (torch.distributed.new_group).
    sp2 = [build_mesh([0, 1], 1, 2), build_mesh([2, 3], 1, 2)][rank // 2]
    tp2 = [build_mesh([0, 1], 2, 1), build_mesh([2, 3], 2, 1)][rank // 2]
    layouts = {"sp=2": sp2, "tp=2": tp2, "tp=2 x sp=2": build_mesh(range(4), 2, 2),
               "sp=4": build_mesh(range(4), 1, 4)}
    result: dict = {"forward": {}, "shapes": {}}
    if device.type != "cpu":  # SP=1 on this GPU: what every layout is compared with
        with torch.no_grad():
            result["reference"] = build_dit(root, SINGLE, device)(*inputs).cpu()
        result["reference step"] = denoise_step(root, SINGLE, device)
    for name, state in layouts.items():
        assert state is not None
        dit = build_dit(root, state, device)
        with torch.no_grad():
            result["forward"][name] = dit(*inputs).cpu()
        single = dit.single_transformer_blocks[0].attn
        result["shapes"][name] = (tuple(dit.transformer_blocks[0].attn.to_q.weight.shape),
                                  tuple(single.to_qkv_mlp_proj.weight.shape), tuple(single.to_out.weight.shape))
    result["step sp=2"] = denoise_step(root, sp2, device)
    return result


@pytest.mark.parametrize("device", devices(4))
def test_dit_split_over_sp_tp_and_tp_x_sp_equals_sp1(checkpoint, device):
    root, reference = checkpoint
    inputs = forward_inputs()
    with torch.no_grad():
        expected = build_dit(root, SINGLE, torch.device("cpu"))(*inputs)
        diffusers_out = reference(*inputs, return_dict=False)[0]
    assert rel_error(expected, diffusers_out) <= TOL  # SP=1 is the reference model
    assert rel_error(expected[0], expected[1]) > 1e-2  # the two requests differ
    expected_step, expected_rows = denoise_step(root, SINGLE, torch.device("cpu"))
    assert expected_rows == [2]  # both requests in one forward

    inner, fused = HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM + 2 * MLP
    whole = ((inner, inner), (fused, inner), (inner, inner + MLP))
    halves = ((inner // 2, inner), (fused // 2, inner), (inner, (inner + MLP) // 2))
    for rank, result in enumerate(run_ranks(_split_runs, 4, root, device, device=device)):
        single, single_step = expected, expected_step
        if device != "cpu":  # the GPU's own SP=1 (a GPU's sums are not the CPU's: loosely equal)
            assert rel_error(result["reference"], expected) <= 1e-4
            single, (single_step, single_rows) = result["reference"], result["reference step"]
            assert single_rows == [2]
        for name, out in result["forward"].items():
            err = rel_error(out, single)
            print(f"[flux2 {device} rank {rank}] forward {name}: max rel err {err:.2e}")
            assert err <= TOL, f"rank {rank} {name}: {err:.3e}"
        for name, shapes in result["shapes"].items():  # TP really splits the weights
            assert shapes == (halves if "tp=2" in name else whole), (rank, name, shapes)
        latents, rows = result["step sp=2"]
        assert rows == [2]
        for i, (ours, ref) in enumerate(zip(latents, single_step)):
            err = rel_error(ours, ref)
            print(f"[flux2 {device} rank {rank}] denoise step sp=2, request {i}: max rel err {err:.2e}")
            assert err <= TOL


def test_flux2_declares_what_its_dit_splits(checkpoint):
    root, _ = checkpoint
    spec = Flux2Klein(parse_config({"model": "flux2_klein", "model_path": str(root)}))
    dims = spec.parallel_dims()
    assert set(dims) == {"dit"}  # the text encoder and the VAE run whole
    assert dims["dit"].tensor == {"num_attention_heads": HEADS, "mlp_hidden_dim": MLP}
    assert dims["dit"].sequence == {"num_attention_heads": HEADS}
    assert dims["dit"].problems(2, 2) == [] and dims["dit"].problems(1, 4) == []
    assert dims["dit"].problems(1, 8) == ["tp_size x sp_size (8) does not divide num_attention_heads (4)"]
    assert dims["dit"].problems(3, 1) == ["tp_size 3 does not divide num_attention_heads (4)",
                                          "tp_size x sp_size (3) does not divide num_attention_heads (4)"]


def test_placement_refuses_a_dit_split_its_heads_do_not_allow(checkpoint):
    root, _ = checkpoint
    groups = [{"node_names": ["text_encoder", "vae"], "ranks": [0]},
              {"node_names": ["dit"], "ranks": [0, 1, 2], "sp_size": 3}]
    config = parse_config({"model": "flux2_klein", "model_path": str(root), "node_groups": groups})
    spec = Flux2Klein(config)
    with pytest.raises(ValueError, match=r"node_groups\[1\]\.sp_size: node 'dit': tp_size x sp_size \(3\) "
                                         r"does not divide num_attention_heads \(4\)"):
        build_placement(spec.graph(), config, spec)
